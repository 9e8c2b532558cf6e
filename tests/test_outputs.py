"""Nothing a user owns is deleted: every tool that writes a directory writes only its own (base/outputs.py). For
each writer, a stranger's file in the target survives, and the refusal is one line naming the directory."""
import json
import os

import pytest

from base.errors import DiskFull, UsageError
from base.outputs import MARKER, output_dir, owned_files
from conftest import invoke, train_main
from helpers import SYNTHETIC, write_job


def test_output_dir_writes_a_new_directory_and_replaces_only_its_own_output(tmp_path):
    out = tmp_path / "out"
    with output_dir(out, "tool") as tmp:
        (tmp / "a.txt").write_text("first")
    assert json.loads((out / MARKER).read_text()) == {"tool": "tool", "files": ["a.txt"]}
    with output_dir(out, "tool") as tmp:  # a previous output of the same tool: replaced whole
        (tmp / "b.txt").write_text("second")
    assert sorted(os.listdir(out)) == [MARKER, "b.txt"]
    assert oct(out.stat().st_mode & 0o777) != oct(0o700)  # not mkdtemp's private mode
    with pytest.raises(UsageError, match=f"^{out}: exists and holds files that other did not write"):
        with output_dir(out, "other"):
            pass


def test_output_dir_refuses_a_directory_with_a_strangers_file_and_leaves_it(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    with pytest.raises(UsageError) as err:
        with output_dir(home, "tool") as tmp:
            (tmp / "x").write_text("x")
    assert str(err.value) == (f"{home}: exists and holds files that tool did not write (e.g. notes.txt); give a new "
                              "or empty directory, or a previous output of tool: nothing there is replaced")
    assert os.listdir(home) == ["notes.txt"] and (home / "notes.txt").read_text() == "mine"
    assert sorted(os.listdir(tmp_path)) == ["home"]  # no temporary left behind


def test_an_unmarked_directory_of_the_tools_own_files_is_its_previous_output(tmp_path):
    """A data set written without the marker (train.jsonl, val.jsonl, stats.json and nothing else) is replaced; the
    same names beside a stranger's file, or a stranger's file alone, are refused."""
    out = tmp_path / "instructions"
    out.mkdir()
    for name in ("train.jsonl", "val.jsonl", "stats.json"):
        (out / name).write_text("old")
    own = ("train.jsonl", "val.jsonl", "stats.json")
    with output_dir(out, "builder", own) as tmp:
        (tmp / "train.jsonl").write_text("new")
    assert sorted(os.listdir(out)) == [MARKER, "train.jsonl"] and (out / "train.jsonl").read_text() == "new"
    mixed = tmp_path / "mixed"
    mixed.mkdir()
    (mixed / "train.jsonl").write_text("old")
    (mixed / "notes.txt").write_text("mine")
    with pytest.raises(UsageError, match=f"^{mixed}: exists and holds files that builder did not write"):
        with output_dir(mixed, "builder", own):
            pass
    assert sorted(os.listdir(mixed)) == ["notes.txt", "train.jsonl"]


def test_a_builder_refuses_a_strangers_directory_before_building_and_leaves_it(tmp_path):
    """`python -m builders.instructions --out DIR` replaces DIR whole: a directory of other files is refused before
    the corpora are read (the error names it), and its files survive."""
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    outcome = invoke("instructions", ["--out", str(home), "--corpora", str(tmp_path / "nowhere")])
    assert outcome.code == 2 and not outcome.traceback
    assert outcome.err.strip().splitlines()[-1].startswith(f"error: {home}: exists and holds files that "
                                                           "builders.instructions did not write (e.g. notes.txt)")
    assert os.listdir(home) == ["notes.txt"] and (home / "notes.txt").read_text() == "mine"


def test_the_task_builder_replaces_only_task_files_it_wrote(tmp_path):
    """`python -m builders.tasks build --out DIR` adds its files to DIR: a file of a task's name that it did not write
    is refused before the build, and left; a directory of nothing but its own file names, without the marker, is an
    earlier build of its own."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "definitions_mc.jsonl").write_text("my own task")
    (mine / "notes.txt").write_text("mine")
    outcome = invoke("tasks", ["build", "--out", str(mine), "--corpora", str(tmp_path / "nowhere")])
    assert outcome.code == 2 and not outcome.traceback
    assert outcome.err.strip().splitlines()[-1] == (f"error: {mine / 'definitions_mc.jsonl'}: exists and was not "
                                                    "written by builders.tasks; move it away (it is not replaced)")
    assert sorted(os.listdir(mine)) == ["definitions_mc.jsonl", "notes.txt"]
    assert (mine / "definitions_mc.jsonl").read_text() == "my own task"
    built = tmp_path / "built"  # an earlier build's files, no marker
    built.mkdir()
    for name in ("definitions_mc.jsonl", "stats.json"):
        (built / name).write_text("old")
    with owned_files(built, "builders.tasks", ["definitions_mc.jsonl"], ["definitions_mc.jsonl", "stats.json"]):
        (built / "definitions_mc.jsonl").write_text("new")
    assert json.loads((built / MARKER).read_text())["files"] == ["definitions_mc.jsonl", "stats.json"]


def test_a_failure_or_a_full_disk_leaves_the_previous_output(tmp_path):
    out = tmp_path / "out"
    with output_dir(out, "tool") as tmp:
        (tmp / "a.txt").write_text("first")
    with pytest.raises(RuntimeError):
        with output_dir(out, "tool") as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("the writer broke")
    with pytest.raises(DiskFull, match=f"^{out}: no space left on the device .* were written when it filled"):
        with output_dir(out, "tool") as tmp:
            (tmp / "half").write_text("x" * 100)
            raise OSError(28, "No space left on device")
    assert sorted(os.listdir(out)) == [MARKER, "a.txt"] and sorted(os.listdir(tmp_path)) == ["out"]


def test_owned_files_overwrite_only_files_the_tool_wrote(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with owned_files(tmp_path, "report", ["report.html"]):
        (tmp_path / "report.html").write_text("v1")
    with owned_files(tmp_path, "report", ["report.html"]):  # its own file: replaced
        (tmp_path / "report.html").write_text("v2")
    (tmp_path / "curves.png").write_text("the user's picture")
    with pytest.raises(UsageError, match="curves.png: exists and was not written by report"):
        with owned_files(tmp_path, "report", ["report.html", "curves.png"]):
            (tmp_path / "curves.png").write_text("overwritten")
    assert (tmp_path / "curves.png").read_text() == "the user's picture"
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_convert_refuses_a_directory_with_a_strangers_file_and_replaces_its_own_export(base_checkpoint, tmp_path):
    out = tmp_path / "hf"
    assert invoke("convert", [base_checkpoint, str(out), "--to", "hf"]).code == 0
    assert invoke("convert", [base_checkpoint, str(out), "--to", "hf"]).code == 0  # its own export: replaced
    assert "model.safetensors" in os.listdir(out)
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    outcome = invoke("convert", [base_checkpoint, str(mine), "--to", "hf"])
    assert outcome.code == 2 and not outcome.traceback
    assert outcome.err.strip().splitlines()[-1].startswith(f"error: {mine}: exists and holds files that "
                                                           "models.convert did not write (e.g. notes.txt)")
    assert os.listdir(mine) == ["notes.txt"]


def test_the_sweep_report_keeps_a_strangers_files(tmp_path):
    sweep = tmp_path / "multirun"
    for num, (lr, lines, status, partial) in SYNTHETIC.items():
        write_job(sweep, num, lr, lines, status, partial)
    (sweep / "notes.txt").write_text("mine")
    assert invoke("report", [str(sweep), "--no-wandb"]).code == 0
    assert invoke("report", [str(sweep), "--no-wandb"]).code == 0  # its own report.html: replaced
    assert (sweep / "notes.txt").read_text() == "mine"
    other = tmp_path / "other"
    write_job(other, 0, *SYNTHETIC[0][:3])
    (other / "report.html").write_text("my own report")
    outcome = invoke("report", [str(other), "--no-wandb"])
    assert outcome.code == 2 and (other / "report.html").read_text() == "my own report"
    assert outcome.err.strip().splitlines()[-1] == (f"error: {other / 'report.html'}: exists and was not written "
                                                    "by sweeps.report; move it away (it is not replaced)")


def test_a_run_directory_holding_other_files_is_refused_before_anything_is_written(tmp_path, monkeypatch):
    home = tmp_path / "home"
    home.mkdir()
    (home / "notes.txt").write_text("mine")
    code, _, err = train_main(tmp_path, monkeypatch, f"hydra.run.dir={home}", "trainer.max_steps=1")
    assert code == 2
    assert err.strip().splitlines()[-1] == (f"config error: hydra.run.dir: {home} holds files that are not a "
                                            "mindlab run's (e.g. notes.txt); give a new directory, e.g. "
                                            "hydra.run.dir=outputs/my_run (hydra.sweep.dir with -m)")
    assert sorted(os.listdir(home)) == [".hydra", "notes.txt", "train.log"] and (home / "notes.txt").read_text() == "mine"


def test_the_dataset_builders_write_only_their_own_output(tmp_path):
    """builders.instructions and builders.preferences replace only their own earlier output; builders.tasks writes
    beside the user's own task files and replaces only the ones it wrote."""
    from builders.instructions import write
    from builders.preferences import write_set
    from builders.tasks import write_tasks

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    sample = {"instruction": "i", "input": "", "output": "o", "task": "t", "entry": "e"}
    with pytest.raises(UsageError, match=f"^{mine}: exists and holds files that builders.instructions did not write"):
        write(mine, [sample], [sample], {})
    with pytest.raises(UsageError, match=f"^{mine}: exists and holds files that builders.preferences did not write"):
        write_set(mine, {"train": [], "val": []}, {})
    assert os.listdir(mine) == ["notes.txt"]
    out = tmp_path / "instructions"
    write(out, [sample], [sample], {})
    write(out, [sample, sample], [sample], {})  # its own output: replaced
    assert len((out / "train.jsonl").read_text().splitlines()) == 2

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "my_task.jsonl").write_text('{"context": "x", "choices": [" a", " b"], "gold": 0}\n')
    item = {"context": "c", "choices": [" a", " b"], "gold": 1}
    write_tasks(tasks, {"verse_mc": [item]}, {})
    write_tasks(tasks, {"verse_mc": [item, item]}, {})
    assert (tasks / "my_task.jsonl").read_text().startswith('{"context": "x"')
    (tasks / "cloze_code.jsonl").write_text("the user's own cloze task\n")
    with pytest.raises(UsageError, match="cloze_code.jsonl: exists and was not written by builders.tasks"):
        write_tasks(tasks, {"cloze_code": [item]}, {})
    assert (tasks / "cloze_code.jsonl").read_text() == "the user's own cloze task\n"


def test_a_recipe_refuses_a_directory_of_other_files(tmp_path):
    from recipe.runner import check_recipe_dir

    (tmp_path / "notes.txt").write_text("mine")
    outcome = invoke("recipe", ["recipe=bert_tiny", f"hydra.run.dir={tmp_path}"])
    assert outcome.code == 2 and outcome.err.strip().splitlines()[-1] == (
        f"config error: hydra.run.dir: {tmp_path} holds files that are not a recipe run's (e.g. notes.txt); give a "
        "new directory, e.g. hydra.run.dir=recipes/my_chain")
    assert (tmp_path / "notes.txt").read_text() == "mine" and not (tmp_path / "stages").exists()
    os.remove(tmp_path / "notes.txt")
    check_recipe_dir(tmp_path)  # Hydra's own files and nothing else: a directory a recipe may use
