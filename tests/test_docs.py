"""The README and docs/ stay true to the tree: every relative link resolves (file and #anchor), and every command in
the README's quick start names a script and config that exist. Planted: a renamed docs page, a heading whose
anchor changed, a quick-start command naming a config that is not there; each fails here."""
import glob
import os
import re
import shlex

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = ['README.md'] + sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, 'docs', '*.md')))


def read(rel):
    with open(os.path.join(ROOT, rel)) as f:
        return f.read()


def slug(heading):
    """GitHub's anchor for a heading: lower case, punctuation dropped (not - or _), spaces to hyphens."""
    return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def headings(text):
    """The anchors of a markdown text's headings (outside code fences)."""
    out, fence = set(), False
    for line in text.splitlines():
        if line.startswith('```'):
            fence = not fence
        elif not fence and (m := re.match(r'^#+ (.*)', line)):
            out.add(slug(m.group(1)))
    return out


def links(text):
    """The relative link targets of a markdown text, outside code fences and code spans."""
    text = re.sub(r'```.*?```', '', text, flags=re.S)
    text = re.sub(r'`[^`\n]*`', '', text)
    return [t for t in re.findall(r'\]\(([^)\s]+)\)', text) if not re.match(r'[a-z]+:', t)]


def test_slug_matches_github():
    assert slug('llada.py: masked diffusion') == 'lladapy-masked-diffusion'
    assert slug('Do the defaults learn on every machine? (`sweep.py`)') == 'do-the-defaults-learn-on-every-machine-sweeppy'
    assert slug('hybrid.py: Nemotron (block diffusion + AR)') == 'hybridpy-nemotron-block-diffusion--ar'


def test_docs_exist():
    # the pages the README promises: one per family plus the cross-cutting ones
    for name in ('llada', 'scdd', 'hybrid', 'gemma_bd', 'dflash', 'idlm', 'ar', 'sampling', 'benchmarks',
                 'reliability', 'tests', 'limitations', 'defaults', 'configuration'):
        assert f'docs/{name}.md' in PAGES, name


def test_every_relative_link_resolves():
    bad = []
    for page in PAGES:
        text = read(page)
        for target in links(text):
            path, _, anchor = target.partition('#')
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            if not os.path.exists(os.path.join(ROOT, dest)):
                bad.append(f'{page}: {target} (no file {dest})')
            elif anchor and dest.endswith('.md') and anchor not in headings(read(dest)):
                bad.append(f'{page}: {target} (no heading #{anchor} in {dest})')
    assert not bad, '\n'.join(bad)


def quick_start_commands():
    """The `python ...` commands of the README's first screen, its quick-start table and its code blocks, up to
    the file map."""
    text = read('README.md')
    text = text[:text.index('\n## What is here')]
    cmds = re.findall(r'^((?:pip|python) [^\n]+)$', text, flags=re.M)  # code-block lines
    cmds += re.findall(r'`(python [^`]+)`', text)  # table cells and inline commands
    return [' '.join(c.split()) for part in cmds for c in part.split('&&') if c.strip().startswith('python')]


def test_quick_start_commands_name_existing_scripts_and_configs():
    cmds = quick_start_commands()
    scripts = {shlex.split(c)[1] for c in cmds}
    assert {'llada.py', 'scdd.py', 'hybrid.py', 'gemma_bd.py', 'dflash.py', 'idlm.py', 'ar.py', 'sample.py'} <= scripts
    for c in cmds:
        words = shlex.split(c)
        if words[1] == '-m':
            continue
        assert os.path.exists(os.path.join(ROOT, words[1])), c
        for w in words[2:]:
            if w.endswith('.py'):
                assert os.path.exists(os.path.join(ROOT, w)), c
            if w.startswith('--'):  # a config key of the script (assigned in its config block) or a sample.py option
                key, source = w[2:].split('=')[0], read(words[1])
                known = re.search(rf"^\s+{key} = ", source, flags=re.M) or f"'{key}'" in source or f"'--{key}'" in source
                assert known, f'{c}: {words[1]} has no key {key}'


def test_readme_is_short():
    assert len(read('README.md').splitlines()) <= 300


def test_docs_named_in_the_code_exist():
    # comments cite docs/<page>.md for a deliberate difference or a measurement; a moved page must not orphan them
    sources = glob.glob(os.path.join(ROOT, '*.py')) + glob.glob(os.path.join(ROOT, 'config', '*.py'))
    named = {(os.path.basename(p), m) for p in sources for m in re.findall(r'docs/\w+\.md', read(p))}
    assert len(named) > 10
    missing = sorted(f'{src}: {page}' for src, page in named if not os.path.exists(os.path.join(ROOT, page)))
    assert not missing, missing
