"""The family scripts' designated duplicated blocks (FAMILY.md: llada.py is the model every family copies): a block
named here is copied verbatim into every family script that has its banner, so a fix made in one copy must be made
in all. Compared textually, indentation and comments included.
Run: python -m pytest -q tests/test_family_contract.py"""
import difflib
import glob
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BANNER = re.compile(r'^\s*# -{20,}\s*$')  # a section banner line: '# ------...'
SHARED = ['distributed init', 'skeleton helpers']  # the sections every family script copies verbatim from llada.py


def section(path, name):
    """The lines of the section `# <name>` of a script: from its title line up to (not including) the next banner
    line. None if the script has no such section."""
    with open(path) as f:
        lines = f.read().splitlines()
    starts = [i for i, ln in enumerate(lines) if ln.strip() == f'# {name}']
    if not starts:
        return None
    assert len(starts) == 1, f'{os.path.basename(path)}: {len(starts)} sections titled # {name}'
    i = starts[0]
    assert i > 0 and BANNER.match(lines[i - 1]), f'{os.path.basename(path)}: # {name} does not follow a banner line'
    end = next((j for j in range(i + 1, len(lines)) if BANNER.match(lines[j])), None)
    assert end is not None, f'{os.path.basename(path)}: no banner line after # {name}'
    return lines[i:end]


@pytest.mark.parametrize('name', SHARED)
def test_shared_sections_are_identical_in_every_family_script(name):
    scripts = sorted(glob.glob(os.path.join(ROOT, '*.py')))
    blocks = {os.path.basename(p): b for p in scripts if (b := section(p, name)) is not None}
    need = {'llada.py', 'ar.py', 'scdd.py', 'hybrid.py', 'gemma_bd.py', 'dflash.py', 'idlm.py'}
    assert need <= set(blocks), f'# {name} missing from {sorted(need - set(blocks))}'
    ref = blocks['llada.py']
    assert len(ref) > 5, ref  # a real block, not an empty title
    for script, block in blocks.items():
        diff = '\n'.join(difflib.unified_diff(ref, block, 'llada.py', script, lineterm=''))
        assert block == ref, f'# {name} of {script} differs from llada.py\'s (copy it verbatim):\n{diff}'
