"""
Tests for configurator.py: the pure core (apply_overrides), the exit/print behaviour of configure,
and --help. Includes every nanoGPT configurator failure listed in STYLE.md §1.1.
Run: OMP_NUM_THREADS=1 python -m pytest -q tests/test_configurator.py
"""
import functools
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import configurator
from configurator import ConfigError, apply_overrides, configure

DEFAULTS = dict(
    out_dir='out-llada', learning_rate=2e-3, n_layer=4, n_embd=128, compile=True,
    wandb_run_name='run', init_from='scratch', start='\n',
)

def write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip('\n'))
    return path

def error_of(argv, defaults=DEFAULTS):
    with pytest.raises(ConfigError) as e:
        apply_overrides(defaults, argv)
    return str(e.value)

@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # so config paths are the short relative ones users type
    return tmp_path

# ----------------------------------------------------------------------------- keys

def test_config_keys_only_plain_public_scalars():
    import math
    class Meters(float):  # a float subclass (like numpy.float64) is not a literal config default
        pass
    g = dict(a=1, b=1.5, c=True, d='x', _private=3, none=None, lst=[1], fn=len, mod=math, __file__='x.py',
             sub=Meters(2.0))
    assert configurator.config_keys(g) == dict(a=1, b=1.5, c=True, d='x')

def test_no_overrides_returns_copy_and_leaves_defaults_alone():
    defaults = dict(DEFAULTS, helper=len)
    config = apply_overrides(defaults, [])
    assert config == DEFAULTS
    config['n_layer'] = 99
    assert defaults['n_layer'] == 4 and defaults['helper'] is len

# ----------------------------------------------------------------------------- command line

def test_cli_int_promoted_to_float():  # nanoGPT: bare AssertionError
    config = apply_overrides(DEFAULTS, ['--learning_rate=1'])
    assert config['learning_rate'] == 1.0 and type(config['learning_rate']) is float
    assert apply_overrides(DEFAULTS, ['--learning_rate=-3e-4'])['learning_rate'] == -3e-4

@pytest.mark.parametrize('raw,expected', [('False', False), ('false', False), ('0', False),
                                          ('True', True), ('true', True), ('1', True)])
def test_cli_bool_words(raw, expected):  # nanoGPT: --compile=false was an AssertionError
    value = apply_overrides(DEFAULTS, [f'--compile={raw}'])['compile']
    assert value is expected

def test_cli_bool_rejects_other_values():
    assert error_of(['--compile=2']) == \
        "command line: compile = 2 has type int, expected bool (True/False/true/false/1/0)"
    assert error_of(['--compile=yes']) == \
        "command line: compile = 'yes' has type str, expected bool (True/False/true/false/1/0)"

def test_cli_str_keeps_raw_text():  # nanoGPT: --wandb_run_name=2024 became an int -> AssertionError
    config = apply_overrides(DEFAULTS, ['--wandb_run_name=2024', '--init_from=out', "--out_dir='q'"])
    assert config['wandb_run_name'] == '2024'
    assert config['init_from'] == 'out'
    assert config['out_dir'] == "'q'"  # raw: the shell already stripped the quotes a user meant

def test_cli_splits_on_first_equals_only():  # nanoGPT: "too many values to unpack"
    assert apply_overrides(DEFAULTS, ['--start=a=b'])['start'] == 'a=b'
    assert apply_overrides(DEFAULTS, ['--out_dir='])['out_dir'] == ''

def test_cli_int_rejects_float_bool_and_text():
    assert error_of(['--n_layer=1.5']) == "command line: n_layer = 1.5 has type float, expected int"
    assert error_of(['--n_layer=True']) == "command line: n_layer = True has type bool, expected int"
    assert error_of(['--n_layer=four']) == "command line: n_layer = 'four' has type str, expected int"
    assert error_of(['--learning_rate=abc']) == \
        "command line: learning_rate = 'abc' has type str, expected float"
    assert apply_overrides(DEFAULTS, ['--n_layer=1_000'])['n_layer'] == 1000

def test_cli_unknown_key_did_you_mean():
    assert error_of(['--lerning_rate=1e-3']) == \
        "unknown config key 'lerning_rate' on the command line (did you mean 'learning_rate'?)"
    assert error_of(['--zzz=1']) == "unknown config key 'zzz' on the command line"

def test_cli_malformed_items():
    assert error_of(['--compile']) == "command line: '--compile' has no value (write --compile=True)"
    assert error_of(['--nope']) == "command line: '--nope' has no value (write --key=value)"
    assert error_of(['-x']) == \
        "command line: unrecognised option '-x' (use --key=value or a config file path)"

def test_cli_last_wins_and_sources():
    sources = {}
    config = apply_overrides(DEFAULTS, ['--n_layer=2', '--n_layer=3'], sources)
    assert config['n_layer'] == 3 and sources == {'n_layer': 'command line'}

# ----------------------------------------------------------------------------- override files

def test_file_overrides_can_read_current_values_and_interleave_with_cli(in_tmp):
    write(in_tmp / 'config/x.py', """
        import math
        _width = 64  # private helper: allowed
        n_embd = _width * n_layer  # reads the current value
        learning_rate = 1  # int -> float promotion, as on the command line
        out_dir = 'out-' + str(int(math.sqrt(16)))
    """)
    sources = {}
    config = apply_overrides(DEFAULTS, ['--n_layer=8', 'config/x.py', '--out_dir=final'], sources)
    assert config['n_embd'] == 512  # saw the CLI value given before the file
    assert config['learning_rate'] == 1.0 and type(config['learning_rate']) is float
    assert config['out_dir'] == 'final'  # the later CLI item wins over the file
    assert sources == {'n_layer': 'command line', 'n_embd': 'config/x.py:3',
                       'learning_rate': 'config/x.py:4', 'out_dir': 'command line'}
    assert '_width' not in config and 'math' not in config

def test_file_typo_is_an_error(in_tmp):  # nanoGPT: silently ignored, default lr used
    write(in_tmp / 'config/x.py', """
        # my config
        n_layer = 2
        learnign_rate = 1e-2
    """)
    assert error_of(['config/x.py']) == \
        "config/x.py:3: unknown config key 'learnign_rate' (did you mean 'learning_rate'?)"

def test_file_helper_function_must_be_private(in_tmp):
    write(in_tmp / 'x.py', """
        n_layer = 2
        def helper():
            return 1
    """)
    assert error_of(['x.py']) == "x.py:2: unknown config key 'helper'"

def test_file_wrong_type_names_line(in_tmp):
    write(in_tmp / 'config/x.py', """
        n_layer = 2

        out_dir = 'o'

        learning_rate = 'abc'
    """)
    assert error_of(['config/x.py']) == "config/x.py:5: learning_rate = 'abc' has type str, expected float"
    write(in_tmp / 'y.py', "compile = 1\n")
    assert error_of(['y.py']) == "y.py:1: compile = 1 has type int, expected bool"
    write(in_tmp / 'z.py', "n_layer = 2.0\n")
    assert error_of(['z.py']) == "z.py:1: n_layer = 2.0 has type float, expected int"

def test_file_missing(in_tmp):
    assert error_of(['config/nope.py']) == \
        "config file 'config/nope.py' not found (paths are relative to the current directory)"

def test_file_syntax_error(in_tmp):
    write(in_tmp / 'bad.py', "n_layer = 2\nlearning_rate = = 1\n")
    msg = error_of(['bad.py'])
    assert msg.startswith('bad.py:2: syntax error: ') and '\n' not in msg

def test_file_runtime_error(in_tmp):
    write(in_tmp / 'bad.py', "n_layer = 2\nn_embd = 64 * n_layers\n")
    assert error_of(['bad.py']) == "bad.py:2: NameError: name 'n_layers' is not defined"

def test_failing_file_applies_nothing(in_tmp):
    write(in_tmp / 'bad.py', "n_layer = 7\nlearnign_rate = 1.0\n")
    defaults = dict(DEFAULTS)
    error_of(['bad.py'], defaults)
    assert defaults == DEFAULTS

# ----------------------------------------------------------------------------- configure()

def test_configure_updates_globals_and_prints_overrides(in_tmp, capsys, monkeypatch):
    monkeypatch.delenv('RANK', raising=False)
    write(in_tmp / 'c.py', "n_layer = 6\n")
    g = dict(DEFAULTS, __file__='train.py', helper=len)
    config = configure(g, ['c.py', '--compile=false'])
    assert g['n_layer'] == 6 and g['compile'] is False and g['helper'] is len
    assert config == dict(DEFAULTS, n_layer=6, compile=False)
    assert capsys.readouterr().out.splitlines() == [
        "config: n_layer = 6  (c.py:1)", "config: compile = False  (command line)"]

def test_configure_silent_on_other_ranks(capsys, monkeypatch):
    monkeypatch.setenv('RANK', '1')
    g = dict(DEFAULTS)
    configure(g, ['--n_layer=3'])
    assert g['n_layer'] == 3 and capsys.readouterr().out == ''

def test_configure_error_exits_2_with_one_line(capsys):
    g = dict(DEFAULTS)
    with pytest.raises(SystemExit) as e:
        configure(g, ['--n_layer=3', '--lerning_rate=1'])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err == "error: unknown config key 'lerning_rate' on the command line (did you mean 'learning_rate'?)\n"
    assert g == DEFAULTS  # nothing half-applied

def test_configure_reads_sys_argv(monkeypatch):
    monkeypatch.setattr(sys, 'argv', ['train.py', '--n_layer=5'])
    assert configure(dict(DEFAULTS))['n_layer'] == 5

# ----------------------------------------------------------------------------- --help

SCRIPT = '''
"""a tiny family script"""
def model(x):
    n_layer = x + 1  # a local of the library half, not the config line
    return n_layer

if __name__ == '__main__':
    out_dir = 'out-tiny'  # where checkpoints go
    n_layer = 2  # transformer blocks
    color = '#fff'  # hex color, with a '#' in the value
    learning_rate = 1e-3
    compile = False  # torch.compile the model
    _private = 1  # not a key
    import configurator
    config = configurator.configure(globals())
    print('RESOLVED', config)
'''

def test_help_lists_keys_defaults_and_comments(tmp_path, capsys):
    script = write(tmp_path / 'tiny.py', SCRIPT)
    g = dict(out_dir='out-tiny', n_layer=2, color='#fff', learning_rate=1e-3, compile=False, _private=1)
    with pytest.raises(SystemExit) as e:
        configure(g, ['--n_layer=9', '--help'], script=str(script))
    assert e.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == 'usage: python tiny.py [config/<file>.py ...] [--key=value ...]'
    rows = {line.split()[0]: line.split(None, 2)[1:] for line in lines[2:]}
    assert rows == {
        "--out_dir='out-tiny'": ['str', 'where checkpoints go'],
        '--n_layer=2': ['int', 'transformer blocks'],
        "--color='#fff'": ['str', "hex color, with a '#' in the value"],
        '--learning_rate=0.001': ['float'],  # no comment in the source: the row still lists it
        '--compile=False': ['bool', 'torch.compile the model'],
    }
    assert g['n_layer'] == 2  # --help applies nothing

def test_help_without_source_still_lists_keys():
    text = configurator.help_text(dict(n_layer=2), script=None)
    assert text.splitlines()[-1].split() == ['--n_layer=2', 'int']

def test_script_end_to_end_in_subprocess(tmp_path):
    script = write(tmp_path / 'tiny.py', SCRIPT)
    write(tmp_path / 'config/tiny_big.py', "n_layer = 2 * n_layer\nlearnign_rate = 1e-2\n")
    env = {'PYTHONPATH': str(Path(configurator.__file__).parent), 'PATH': '/usr/bin:/bin'}

    def run(*args):
        return subprocess.run([sys.executable, str(script), *args], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=60)
    ok = run('--learning_rate=1', '--compile=true')
    assert ok.returncode == 0, ok.stderr
    assert "config: learning_rate = 1.0  (command line)" in ok.stdout
    assert "'learning_rate': 1.0, 'compile': True" in ok.stdout
    bad = run('config/tiny_big.py')
    assert bad.returncode == 2 and bad.stdout == ''
    assert bad.stderr == \
        "error: config/tiny_big.py:2: unknown config key 'learnign_rate' (did you mean 'learning_rate'?)\n"
    helped = run('-h')
    assert helped.returncode == 0
    assert ['--n_layer=2', 'int', 'transformer', 'blocks'] in [l.split() for l in helped.stdout.splitlines()]


@functools.lru_cache(maxsize=None)
def script_help(script):
    """`<script> --help`, once per script (a process start imports torch and transformers: seconds each)."""
    return subprocess.run([sys.executable, str(script), '--help'], cwd=script.parent, capture_output=True,
                          text=True).stdout


@pytest.mark.slow
@pytest.mark.parametrize('path', sorted(Path(__file__).resolve().parents[1].glob('config/*.py')),
                         ids=lambda p: p.name)
def test_shipped_configs_apply_to_their_script(path):
    # every recipe in config/ is valid for its family script (config/<family>_<variant>.py -> <family>.py, the
    # longest script name that prefixes it: gemma_bd_tiny.py -> gemma_bd.py): each key exists there with the right
    # type. The script's keys, defaults and types come from its --help
    import ast
    import re
    root = path.parents[1]
    fits = [p.stem for p in root.glob('*.py') if path.name.startswith(p.stem + '_')]
    script = root / ((max(fits, key=len) if fits else path.name.split('_')[0]) + '.py')
    assert script.is_file(), f'{path.name}: no family script {script.name}'
    out = script_help(script)
    defaults = {k: ast.literal_eval(v) for k, v in re.findall(r'^  --(\w+)=(.*?)\s{2,}\w+\s', out, re.M)}
    assert len(defaults) > 20, out
    config = apply_overrides(defaults, [str(path)])  # raises ConfigError naming file:line on a bad key or type
    assert config.keys() == defaults.keys()
    if 'identical to plain' in path.read_text():  # the embedded default spelled out: a default change moves it too
        changed = {k: (defaults[k], v) for k, v in config.items() if v != defaults[k]}
        assert not changed, f'{path.name} says it is the default of {script.name} but differs: {changed} (default, file)'
