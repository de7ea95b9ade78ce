"""
Poor Man's Configurator, take two: nanoGPT's exec-style config, but with checks and --help.

A family script declares its config as plain globals (literal defaults, one inline comment each)
and hands them to this module from its script half:

    if __name__ == '__main__':
        out_dir = 'out-llada'  # where checkpoints go
        learning_rate = 2e-3  # peak AdamW lr
        ...
        import configurator
        config = configurator.configure(globals())  # reads sys.argv[1:], updates the globals

which is then run as

    python llada.py config/llada_tiny.py --learning_rate=1e-3 --compile=False
    python llada.py --help      # every key with its type, default and comment
    python llada.py --plan=8x80 # the memory plan per GPU on 8 GPUs of 80 GiB (plan.py), then exit

Config keys are the script's public globals (no leading '_') holding an int, float, bool or str.
The command line is applied left to right, so later items win:
- An item without a leading '--' is an override file: a Python file exec'd into a scratch namespace
  pre-filled with the current values (so it may say `n_embd = 64 * n_layer`). Afterwards every public
  name it left behind (modules excepted) must be a known key with the right type, so a typo such as
  `learnign_rate = 1e-2` is an error instead of a silently ignored new global (nanoGPT's worst trap).
  Name any helper variables `_like_this`. Override files are TRUSTED user code: they are exec'd with
  full Python powers, exactly like the script itself, so only pass files you would run as scripts.
- `--key=value` sets one key. The value is parsed with ast.literal_eval (falling back to the raw text)
  and must match the default's type, with three conveniences: an int is promoted to a float
  (`--learning_rate=1`), a bool accepts True/False/true/false/1/0, and a str key keeps the raw text
  (`--wandb_run_name=2024` is '2024'). Only the first '=' splits, so `--start=a=b` sets start to 'a=b'.

Any mistake (unknown key, wrong type, missing file, error in a file) prints one line `error: ...`
naming the source ('command line' or file:line) to stderr and exits with status 2, like argparse;
usage_error() does the same for the scripts' own checks of the resolved settings.
Tests use the pure core `apply_overrides(defaults, argv)`, which raises ConfigError instead.
"""

import ast
import difflib
import io
import os
import sys
import tokenize
import traceback
import types

BOOL_WORDS = {'True': True, 'true': True, '1': True, 'False': False, 'false': False, '0': False}
LITERAL_ERRORS = (ValueError, TypeError, SyntaxError, MemoryError, RecursionError)  # what literal_eval raises

class ConfigError(ValueError):
    """A bad override. The message is one line that starts with (or names) its source."""

def config_keys(g):
    """The config entries of a namespace: public names whose value is exactly a bool/int/float/str."""
    # exact type, not isinstance: bool is a subclass of int, and numpy scalars etc. are not config
    return {k: v for k, v in g.items() if not k.startswith('_') and type(v) in (bool, int, float, str)}

def _did_you_mean(key, keys):
    close = difflib.get_close_matches(key, keys, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ''

def _check_type(key, value, default, where, hint=''):
    """value converted to the type of default, or ConfigError. int -> float is the only promotion."""
    if type(value) is int and type(default) is float:
        return float(value)
    if type(value) is not type(default):
        raise ConfigError(f"{where}: {key} = {value!r} has type {type(value).__name__}, "
                          f"expected {type(default).__name__}{hint}")
    return value

def _parse_cli(key, raw, default):
    """The typed value of `--key=raw`, given the key's current value."""
    if type(default) is str:
        return raw  # keep the raw text: --wandb_run_name=2024 means '2024', --init_from=out means 'out'
    if type(default) is bool and raw in BOOL_WORDS:
        return BOOL_WORDS[raw]  # --compile=false must not become the (truthy) string 'false'
    try:
        value = ast.literal_eval(raw)
    except LITERAL_ERRORS:
        value = raw  # not a Python literal: keep the text, the type check below names it
    hint = ' (True/False/true/false/1/0)' if type(default) is bool else ''
    return _check_type(key, value, default, 'command line', hint)

def _assigned_lines(tree):
    """{name: line of its last binding} in a parsed file, to point errors at the offending line."""
    lines = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            name = node.id
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        else:
            continue
        lines[name] = max(node.lineno, lines.get(name, 0))
    return lines

def _apply_file(path, config, sources):
    """exec one override file on top of config (in place), checking every name it defines."""
    try:
        with open(path, encoding='utf-8') as f:
            source = f.read()
    except FileNotFoundError:
        raise ConfigError(f"config file '{path}' not found (paths are relative to the current directory)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read config file '{path}': {e}") from None
    try:
        tree = ast.parse(source, path)
        code = compile(tree, path, 'exec')
    except (SyntaxError, ValueError) as e:  # ValueError: null bytes in the source
        raise ConfigError(f"{path}:{getattr(e, 'lineno', '?')}: syntax error: {getattr(e, 'msg', e)}") from None
    scratch = dict(config, __file__=path)  # a copy: a failing file leaves config untouched
    try:
        exec(code, scratch)
    except Exception as e:  # anything the user's file raises becomes one line pointing into the file
        frames = [fr for fr in traceback.extract_tb(e.__traceback__) if fr.filename == path]
        line = frames[-1].lineno if frames else '?'
        detail = ' '.join(str(e).split())  # one line, even for multi-line exception messages
        raise ConfigError(f"{path}:{line}: {type(e).__name__}{': ' + detail if detail else ''}") from None
    lines = _assigned_lines(tree)
    updates = {}
    for name, value in scratch.items():
        if name.startswith('_') or isinstance(value, types.ModuleType):
            continue  # private helpers, __builtins__, __file__, `import math`
        where = f"{path}:{lines[name]}" if name in lines else path
        if name not in config:
            raise ConfigError(f"{where}: unknown config key '{name}'{_did_you_mean(name, config)}")
        value = _check_type(name, value, config[name], where)
        if name in lines or value != config[name]:
            updates[name] = value
            sources[name] = where
    config.update(updates)

def apply_overrides(defaults, argv, sources=None):
    """
    The resolved config: config_keys(defaults) with the override files and --key=value items of argv
    applied left to right. Raises ConfigError; never exits, prints or touches defaults.
    If sources is a dict it is filled with {key: where it was last set} ('command line' or file:line).
    """
    config = config_keys(defaults)
    sources = {} if sources is None else sources
    for arg in argv:
        if not arg.startswith('-'):
            _apply_file(arg, config, sources)
        elif arg.startswith('--') and '=' in arg:
            key, raw = arg[2:].split('=', 1)  # only the first '=' splits: --start=a=b sets start='a=b'
            if key not in config:
                raise ConfigError(f"unknown config key '{key}' on the command line{_did_you_mean(key, config)}")
            config[key] = _parse_cli(key, raw, config[key])
            sources[key] = 'command line'
        elif arg.startswith('--'):
            example = f"--{arg[2:]}={config[arg[2:]]!r}" if arg[2:] in config else '--key=value'
            raise ConfigError(f"command line: '{arg}' has no value (write {example})")
        else:
            raise ConfigError(f"command line: unrecognised option '{arg}' (use --key=value or a config file path)")
    return config

def _inline_comments(path, config):
    """{key: trailing comment of the line that assigns its default} from the script's source."""
    try:
        with open(path, encoding='utf-8') as f:
            source = f.read()
        tree = ast.parse(source)
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError, tokenize.TokenError):
        return {}  # no readable source (e.g. an interactive session): --help just lists the keys
    comments = {t.start[0]: t.string.lstrip('#').strip() for t in tokens if t.type == tokenize.COMMENT}
    best = {}  # key -> (rank, comment); prefer the line assigning the literal default, then the first line
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)):
            continue
        target = node.targets[0]
        if target.id not in config or node.end_lineno not in comments:
            continue
        try:
            is_default = ast.literal_eval(node.value) == config[target.id]
        except LITERAL_ERRORS:
            is_default = False
        rank = (not is_default, node.lineno)
        if target.id not in best or rank < best[target.id][0]:
            best[target.id] = (rank, comments[node.end_lineno])
    return {key: comment for key, (_, comment) in best.items()}

def help_text(g, script=None):
    """Usage plus one row per key: --key=default, type, inline comment from the script source."""
    config = config_keys(g)
    comments = _inline_comments(script, config) if script else {}
    rows = [(f"--{k}={v!r}", type(v).__name__, comments.get(k, '')) for k, v in config.items()]
    width = max((len(r[0]) for r in rows), default=0)
    name = os.path.basename(script) if script else 'script.py'
    lines = [f"usage: python {name} [config/<file>.py ...] [--key=value ...]",
             "override files (trusted Python, exec'd) and --key=value apply left to right; --plan[=<GPUs>x<GiB>] "
             "prints the run's memory plan per GPU and exits (plan.py); keys and defaults:"]
    lines += [f"  {arg:<{width}}  {typ:<5}  {comment}".rstrip() for arg, typ, comment in rows]
    return '\n'.join(lines)

def usage_error(message):
    """A usage error: `error: message` on stderr (rank 0 only under torchrun: every rank finds the same), exit 2."""
    if int(os.environ.get('RANK', 0)) == 0:
        print(f"error: {message}", file=sys.stderr)
    sys.exit(2)

def configure(g, argv=None, script=None, sources=None):
    """
    Apply sys.argv[1:] (or argv) to the config globals g in place and return the resolved {key: value}.
    --help/-h prints help_text and exits 0 (also into a closed pipe: `--help | head -2`); any ConfigError is a
    usage_error. If sources is a dict it is filled with {key: where it was set} (see apply_overrides).
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    if '--help' in argv or '-h' in argv:
        try:
            print(help_text(g, script if script is not None else g.get('__file__')))
            sys.stdout.flush()
        except BrokenPipeError:  # the reader left early; keep Python's exit-time flush from raising it again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(0)
    plan_args = [a for a in argv if a == '--plan' or a.startswith('--plan=')]  # plan.py: the memory plan, then exit
    argv = [a for a in argv if a not in plan_args]
    sources = {} if sources is None else sources
    try:
        config = apply_overrides(g, argv, sources)
    except ConfigError as e:
        usage_error(e)
    g.update(config)
    if plan_args:  # before the scripts' own settings checks: a plan is also how to find settings that fit
        import plan
        plan.main(g.get('FAMILY', ''), config, plan_args[-1].partition('=')[2])
    if int(os.environ.get('RANK', 0)) == 0:  # under torchrun only rank 0 talks
        for key, where in sources.items():
            print(f"config: {key} = {config[key]!r}  ({where})")
    return config
