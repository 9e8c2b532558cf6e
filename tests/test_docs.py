"""The guide cannot drift from the code, and carries no history.

Every command in README.md and docs/*.md (code blocks: indented four spaces, or fenced) is checked against what it
calls, without training anything:
  python train.py / prepare.py ARGS   composed as train.py composes them (the first value of a sweep) and validated
                                      with dry_run=true: a renamed key, group or preset fails here
  python -m recipe ARGS               the recipe composed, its stages parsed and planned (each one validated)
  python -m evaluation CKPT ARGS      its eval.* keys and train.py overrides checked as evaluation checks them
  python -m <module> ARGS             the module exists, and each --flag it is given is one its --help lists
Placeholders in commands (CKPT, OUT, <...>, $VARS) are fine where a path goes: nothing is read.

And no history in the guide, the code or the YAML: no pass numbers ("the fourth pass"), issue numbers, commit
hashes (but benchmarks/RESULTS.md's stamps, which say what was measured) or seed-article ids; git keeps the history.
"""
import contextlib
import importlib
import importlib.util
import inspect
import io
import os
import re
import shlex
import sys
from pathlib import Path
from typing import List, Tuple

import pytest

from conftest import ROOT

ROOT = Path(ROOT)
DOCS = [ROOT / "README.md", ROOT / "README.zh-CN.md"] + sorted((ROOT / "docs").glob("*.md"))
PROGRAM = re.compile(r"^(?:scripts/venv\.sh )?(python3? (?:train\.py|prepare\.py|-m [\w.]+)\b.*)$")  # ("$ python ...":
# a transcript, which may show a refusal on purpose, is not a command to check)


def commands(path: Path) -> List[Tuple[int, str]]:
    """(line, command) of every `python ...` command in a code block of `path`, continuation lines joined."""
    out, fenced, pending, start = [], False, "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        code = fenced or line.startswith("    ")
        text = line.strip() if code else ""
        if pending:
            pending += " " + text.rstrip("\\").strip()
            if not text.endswith("\\"):
                out.append((start, pending))
                pending = ""
            continue
        match = PROGRAM.match(text)
        if match:
            if text.endswith("\\"):
                pending, start = match.group(1).rstrip("\\").strip(), number
            else:
                out.append((number, match.group(1)))
    return out


def split(command: str) -> List[str]:
    """The command's words, placeholders made concrete: <anything> and $VARS (a path, a node rank) become 1."""
    command = re.sub(r"<[^<>]*>", "1", command)
    return [re.sub(r"\$\{?\w+\}?", "1", word) for word in shlex.split(command, comments=True)]


ALL = [(path, number, command) for path in DOCS for number, command in commands(path)]


def first_job(overrides: List[str]) -> List[str]:
    """The first job of a sweep's overrides (each sweep's first value), as the basic sweeper would run it."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    if not any(o.is_sweep_override() for o in parsed):
        return overrides
    return list(BasicSweeper.split_arguments(parsed, None)[0][0])


def check_train(args: List[str]) -> None:
    """Composed and validated in a dry run; a fragment (`...` for what it leaves out) composed only."""
    from base.validate import validate
    from conftest import compose_cfg

    overrides = [a for a in args if a not in ("-m", "--multirun", "...") and not a.startswith("--")]
    cfg = compose_cfg(*[a for a in first_job(overrides) if not a.startswith("hydra")], "dry_run=true")
    if not any("..." in a for a in args):
        validate(cfg)


def prepare_overrides(args: List[str]) -> List[str]:
    """prepare.py's config overrides: its fan-out words (step=, part=) checked as it checks them, then dropped."""
    from prepare import fan_out

    return fan_out(args)[0]


def check_recipe(args: List[str], tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    import recipe.__main__  # noqa: F401  (registers the recipe app's nodes)
    from conftest import compose_cfg
    from recipe.runner import plan
    from recipe.spec import parse

    overrides = [a for a in first_job([a for a in args if a not in ("-m", "--multirun")]) if not a.startswith("hydra")]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="recipe_app", overrides=overrides)
    name = next(a.split("=", 1)[1] for a in overrides if a.startswith("recipe="))
    from omegaconf import OmegaConf

    declared = list((OmegaConf.load(ROOT / "conf" / "recipe" / f"{name}.yaml").get("stages") or {}).keys())
    presets = sorted(p.stem for p in (ROOT / "conf" / "stage").glob("*.yaml"))
    plan(parse(cfg.recipe, declared, presets), tmp_path, compose=lambda stage: compose_cfg(*stage))


def help_text(module: str, args: List[str]) -> str:
    """The module's --help (its leading words kept: a subcommand's own help), or "" for a module without argparse."""
    if importlib.util.find_spec(module).submodule_search_locations is not None:  # a package: -m runs its __main__
        module += ".__main__"
    source = Path(importlib.util.find_spec(module).origin).read_text(encoding="utf-8")
    if "ArgumentParser" not in source:
        return ""
    words = [a for a in args if not a.startswith("-")][:1] if "add_subparsers" in source else []
    saved, out = sys.argv, io.StringIO()
    sys.argv = [module, *words, "--help"]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
            try:
                mod = importlib.import_module(module)
                main = getattr(mod, "main", None)
                if main is not None:  # (a main without parameters reads sys.argv)
                    main([*words, "--help"]) if inspect.signature(main).parameters else main()
            except SystemExit:
                pass
    finally:
        sys.argv = saved
    return out.getvalue()


@pytest.mark.parametrize("path, number, command", ALL, ids=[f"{p.name}:{n}" for p, n, _ in ALL])
def test_every_documented_command_matches_the_code(path, number, command, tmp_path):
    args = split(command)[1:]
    if args[0] in ("train.py", "prepare.py"):
        if "--help" not in args:
            check_train(args[1:] if args[0] == "train.py" else prepare_overrides(args[1:]))
        return
    module, rest = args[1], args[2:]
    assert importlib.util.find_spec(module) is not None, f"{path.name}:{number}: no module {module}"
    if module == "recipe":
        if "--help" not in rest:
            check_recipe(rest, tmp_path)
        return
    if module == "evaluation":
        from evaluation.config import split_arguments

        split_arguments([a for a in rest[1:] if "=" in a and not a.startswith("-")])  # eval.* keys, tasks=
    flags = [a.split("=")[0] for a in rest if a.startswith("--")]
    if flags:
        text = help_text(module, rest)
        missing = [f for f in flags if f not in text]
        assert not missing, f"{path.name}:{number}: {module} does not take {', '.join(missing)}"


def test_the_chinese_readme_mirrors_the_readme():
    """README.zh-CN.md holds every command of README.md, and its sections in the same order (each checked above)."""
    english, chinese = ({c.split(" #")[0].strip() for _, c in commands(ROOT / name)}
                        for name in ("README.md", "README.zh-CN.md"))  # the commands, without their comments
    missing = sorted(english - chinese)
    assert not missing, f"README.zh-CN.md lacks: {missing}"
    count = lambda name: sum(line.startswith("## ") for line in (ROOT / name).read_text(encoding="utf-8").splitlines())
    assert count("README.zh-CN.md") == count("README.md") + 1  # and a section on the Chinese pipeline


def test_the_check_fails_on_a_renamed_key(tmp_path):
    """What the test above does with a command whose key was renamed (optim.lr -> optim.learning_rate) or whose flag
    was (--max-new-tokens -> --new-tokens): it fails, naming it."""
    from base.validate import ConfigError

    with pytest.raises(ConfigError, match="optim.learning_rate"):
        check_train(split("python train.py stage=tiny_pretrain +optim.learning_rate=1e-3")[2:])
    with pytest.raises(Exception, match="Could not override 'optim.learning_rate'"):
        check_train(split("python train.py optim.learning_rate=1e-3")[2:])
    assert "--new-tokens" not in help_text("generate", ["CKPT", "--new-tokens", "8"])
    assert "--max-new-tokens" in help_text("generate", ["CKPT", "--max-new-tokens", "8"])


def test_the_guide_is_a_guide():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= 250, f"README.md has {len(readme)} lines: move detail into docs/"
    for page in sorted((ROOT / "docs").glob("*.md")):
        lines = page.read_text(encoding="utf-8").splitlines()
        assert len(lines) <= 300, f"{page.name} has {len(lines)} lines"
    assert not (ROOT / "benchmarks" / "HISTORY.md").exists()


ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|"
            "fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth|twenty-\\w+")
HISTORY = re.compile(rf"\b(?:the (?:{ORDINALS}|\d+(?:st|nd|rd|th)) pass(?:es)?\b|pass \d+\b|\bissues? #?\d+\b|"
                     rf"\bseed 0\d\d\b)", re.IGNORECASE)
HASH = re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,12}\b")  # a short commit id in prose


def history_files():
    skip = {".git", "tests", "outputs", "multirun", "recipes"}
    for path in sorted(ROOT.rglob("*")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in skip or not path.is_file():
            continue
        if path.suffix in (".py", ".yaml", ".md", ".cc", ".h", ".sh", ".sbatch") or path.name in ("Makefile", "run"):
            yield path


def test_no_history_in_the_guide_the_code_or_the_yaml():
    found = []
    for path in history_files():
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if HISTORY.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}: {HISTORY.search(line).group(0)!r}")
            if path.suffix == ".md" and path.name != "RESULTS.md" and HASH.search(line) and "sha256" not in line.lower():
                found.append(f"{path.relative_to(ROOT)}:{number}: {HASH.search(line).group(0)!r} (a commit id?)")
    assert not found, "history belongs in git:\n" + "\n".join(found[:60]) + (f"\n... {len(found) - 60} more"
                                                                           if len(found) > 60 else "")
