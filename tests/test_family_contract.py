"""The family contract (FAMILY.md): the run machinery lives once, in skeleton.py. Every family script imports it and
defines no copy of it (no function, class or constant of its own under one of skeleton's public names), so a fix made
in skeleton.py reaches every family and a fork of a family carries only its method and its loop.
Run: python -m pytest -q tests/test_family_contract.py"""
import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FAMILIES = ['llada.py', 'ar.py', 'scdd.py', 'hybrid.py', 'gemma_bd.py', 'dflash.py', 'idlm.py']


def parse(name):
    with open(os.path.join(ROOT, name)) as f:
        return ast.parse(f.read(), name)


def public_names(tree):
    """The top-level functions, classes and constants a module defines (not the names it imports)."""
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return {n for n in names if not n.startswith('_')}


def test_skeleton_holds_the_run_machinery():
    names = public_names(parse('skeleton.py'))
    for need in ('init_distributed', 'print0', 'all_sum', 'from_rank0', 'fail', 'settings_error', 'save_run',
                 'load_run', 'lock_out_dir', 'StopSignal', 'get_lr'):
        assert need in names, f'skeleton.py lost {need}'


@pytest.mark.parametrize('script', FAMILIES)
def test_family_imports_the_skeleton_and_copies_none_of_it(script):
    tree = parse(script)
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == 'skeleton'
                for a in n.names} | {'*' for n in ast.walk(tree) if isinstance(n, ast.Import)
                                     and any(a.name == 'skeleton' for a in n.names)}
    assert imported, f'{script} does not import skeleton'
    shared = public_names(parse('skeleton.py'))
    defined = {n.name: n.lineno for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    copies = sorted(f'{name} (line {line})' for name, line in defined.items() if name in shared)
    assert not copies, f'{script} defines its own copy of skeleton.py\'s {", ".join(copies)}: import it instead'


def test_shared_modules_name_each_public_function_once():
    # one name, one function across the shared modules (family scripts repeat make_batch, corrupt, ... on purpose:
    # a fork keeps the roles' names); hf.attention_mask and kernels.attention_mask were two different functions
    import collections
    owners = collections.defaultdict(list)
    for name in ('skeleton.py', 'hf.py', 'dlm_kernels.py', 'sample.py', 'configurator.py', 'bench.py', 'sweep.py',
                 'data/loader.py', 'data/prepare.py', 'data/synthetic.py', 'data/tokenizer.py', 'data/regenerate.py'):
        with open(os.path.join(ROOT, name)) as f:
            for node in ast.parse(f.read()).body:
                if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith('_'):
                    owners[node.name].append(name)
    clashes = {k: v for k, v in owners.items() if len(v) > 1 and k != 'main'}
    assert not clashes, clashes


def test_no_script_shadows_an_installed_package():
    # the scripts' folder is first on sys.path, so a top-level foo.py hides an installed package foo from every
    # library that imports it: transformers 5.25 imports the PyPI package `kernels`, and a kernels.py here broke it
    import importlib.metadata
    installed = set(importlib.metadata.packages_distributions())
    ours = {f[:-3] for f in os.listdir(ROOT) if f.endswith('.py')} | \
        {d for d in os.listdir(ROOT) if os.path.isfile(os.path.join(ROOT, d, '__init__.py'))}
    assert not ours & installed, f'these files shadow installed packages of the same name: {sorted(ours & installed)}'


def test_float32_means_ieee_on_cuda_and_bfloat16_allows_tf32():
    """--dtype=float32 is IEEE float32 on CUDA, flex_attention's Triton kernels included (inductor reads its fp32
    precision from this flag): bench.py's per-family GPU check compares flex with SDPA in float32, and with TF32 on
    gemma_bd's drifted past its tolerance. bfloat16 autocast keeps TF32 for the float32 matmuls it leaves. The
    flags are plain settings, so this runs on a CPU build."""
    import torch
    import skeleton
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        assert skeleton.precision('auto', 'cuda')[0] == 'bfloat16' and torch.backends.cuda.matmul.allow_tf32, \
            'auto on CUDA: bfloat16 autocast with TF32'
        assert skeleton.precision('float32', 'cuda')[0] == 'float32'
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32, 'float32: no TF32'
        from torch._inductor.kernel.flex.flex_attention import get_float32_precision
        assert get_float32_precision() == "'ieee'", 'float32: flex kernels in IEEE float32'
        skeleton.precision('bfloat16', 'cuda')
        assert get_float32_precision() == "'tf32'", 'bfloat16: flex may use TF32 for what autocast leaves'
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before
