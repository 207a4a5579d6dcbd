"""What `featcal merge`, `calibrate`, `evaluate` and `sweep` refuse before any work: outputs that would
destroy something, damaged model folders, inputs that would give a wrong answer; and what no error
message may show."""

import json
import shutil
from pathlib import Path

import pytest

from featcal.cli import main
from featcal.cli.errors import hide_secrets
from featcal.errors import FeatcalError, OutputPathError
from featcal.files.atomic import replace_dir
from featcal.outputs import check_output_file, check_output_folder
from tests.support.read_only import make_read_only
from tests.support.release_runs import make_run
from tests.support.runs import CPU


def run_error(capsys, argv):
    code = main(["-q", *argv])
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


def copy_world(world, tmp_path) -> Path:
    root = tmp_path / "w"
    shutil.copytree(world["root"], root)
    return root


def tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# --- output folders ----------------------------------------------------------------------------------


def test_merge_refuses_a_folder_holding_other_files_and_leaves_it_alone(world, tmp_path, capsys):
    out = tmp_path / "keep"
    out.mkdir()
    (out / "thesis.tex").write_text("mine")
    code, err = run_error(capsys, ["merge", "--tasks-file", str(world["tasks_file"]), "--output", str(out), *CPU])
    assert code == 2 and len(err) == 1
    assert "thesis.tex" in err[0] and "choose another output folder" in err[0]
    assert tree(out) == {"thesis.tex": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep"]  # no temporary folder beside it


def test_merge_into_the_base_folder_is_refused(world, tmp_path, capsys):
    root = copy_world(world, tmp_path)
    before = tree(root / "base")
    code, err = run_error(
        capsys, ["merge", "--tasks-file", str(root / "tasks.json"), "--output", str(root / "base"), *CPU]
    )
    # refused before the inputs are resolved (and downloaded): the base holds files no merged model has
    assert code == 2 and len(err) == 1 and "tokenizer" in err[0] and "choose another output folder" in err[0]
    assert tree(root / "base") == before


def test_merge_into_an_expert_folder_is_refused(world, tmp_path, capsys):
    """An expert folder holds only what a merged model does: the check against the resolved inputs refuses it."""
    root = copy_world(world, tmp_path)
    expert = root / "experts" / world["tasks"][0]
    before = tree(expert)
    code, err = run_error(capsys, ["merge", "--tasks-file", str(root / "tasks.json"), "--output", str(expert), *CPU])
    assert code == 2 and len(err) == 1 and "would replace the input" in err[0]
    assert tree(expert) == before


def test_calibrate_onto_its_own_merged_folder_is_refused(world, tmp_path, capsys):
    common = ["--tasks-file", str(world["tasks_file"]), *CPU]
    assert main(["-q", "merge", "--output", str(tmp_path / "m"), *common]) == 0
    before = tree(tmp_path / "m")
    code, err = run_error(
        capsys, ["calibrate", "--merged", str(tmp_path / "m"), "--output", str(tmp_path / "m"), *common]
    )
    assert code == 2 and len(err) == 1 and "would replace the input" in err[0]
    assert tree(tmp_path / "m") == before


def test_merge_replaces_its_own_earlier_output(world, tmp_path):
    common = ["--tasks-file", str(world["tasks_file"]), *CPU]
    assert main(["-q", "merge", "--output", str(tmp_path / "m"), *common]) == 0
    assert main(["-q", "merge", "--output", str(tmp_path / "m"), *common, "--ta-scaling-factor", "0.5"]) == 0
    names = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert names == ["config.json", "featcal_recipe.json", "mergekit_config.yml", "model.safetensors"]
    assert json.loads((tmp_path / "m" / "featcal_recipe.json").read_text())["merge"]["params"]["scaling_factor"] == 0.5


@pytest.mark.parametrize("bad", ["", "file", "file/sub"])
def test_output_folder_that_is_empty_or_under_a_file(tmp_path, bad):
    (tmp_path / "file").write_text("x")
    target = "" if bad == "" else str(tmp_path / bad)
    with pytest.raises(OutputPathError):
        check_output_folder(target, kind="merged model")
    assert (tmp_path / "file").read_text() == "x"


def test_output_folder_may_not_hold_or_lie_inside_an_input(tmp_path):
    (tmp_path / "models" / "base").mkdir(parents=True)
    for folder in (tmp_path / "models", tmp_path / "models" / "base", tmp_path / "models" / "base" / "out"):
        with pytest.raises(OutputPathError, match="would replace the input"):
            check_output_folder(folder, kind="merged model", inputs=[tmp_path / "models" / "base"])
    assert check_output_folder(
        tmp_path / "models" / "merged", kind="merged model", inputs=[tmp_path / "models" / "base"]
    )


def test_output_file_may_not_be_a_folder(tmp_path):
    with pytest.raises(OutputPathError, match="is a folder"):
        check_output_file(tmp_path, kind="metrics file")
    assert check_output_file(tmp_path / "m.json", kind="metrics file") == (tmp_path / "m.json").resolve()


def test_replacing_a_file_with_a_folder_is_refused(tmp_path):
    (tmp_path / "final").write_text("mine")
    (tmp_path / "tmp").mkdir()
    with pytest.raises(FeatcalError, match="is a file"):
        replace_dir(tmp_path / "tmp", tmp_path / "final")
    assert (tmp_path / "final").read_text() == "mine"
    assert not (tmp_path / ".final.old").exists()


def test_evaluate_does_not_overwrite_a_run_s_metrics(world, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(world["root"] / "experts" / world["tasks"][0], run / "featcal-ta")
    (run / "run_config.json").write_text("{}")
    (run / "featcal-ta" / "metrics.json").write_text('{"the": "run s own"}')
    code, err = run_error(
        capsys,
        ["evaluate", "--model", str(run / "featcal-ta"), "--tasks-file", str(world["tasks_file"]), *CPU],
    )
    assert code == 2 and len(err) == 1 and "--output FILE" in err[0] and "record" in err[0]
    assert (run / "featcal-ta" / "metrics.json").read_text() == '{"the": "run s own"}'
    argv = ["evaluate", "--model", str(run / "featcal-ta"), "--tasks-file", str(world["tasks_file"]), *CPU]
    assert main(["-q", *argv, "--eval-num-workers", "0", "--output", str(tmp_path / "m.json")]) == 0
    assert "average" in json.loads((tmp_path / "m.json").read_text())
    assert (run / "featcal-ta" / "metrics.json").read_text() == '{"the": "run s own"}'
    release = tmp_path / "release"  # a release folder: its metrics.json is what push publishes
    shutil.copytree(world["root"] / "experts" / world["tasks"][0], release)
    (release / "release_manifest.json").write_text("{}")
    code, err = run_error(capsys, ["evaluate", "--model", str(release), "--tasks-file", str(world["tasks_file"]), *CPU])
    assert code == 2 and len(err) == 1 and "a release's record" in err[0]
    assert not (release / "metrics.json").exists()


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("model", "would replace the input"),  # the evaluated model's own weights
        ("base", "would replace the input"),  # a file of the base
        ("tasks", "would replace the input"),  # the tasks file
        ("dataset", "would replace the input"),  # a dataset's parquet
        ("stage", "lies in the run folder"),  # a run's stage results: tied to the stage's weights
        ("run_config", "lies in the run folder"),
        ("other", "exists and is not a featcal metrics report"),  # an unrelated file
    ],
)
def test_evaluate_writes_its_metrics_over_nothing_but_a_metrics_report(world, tmp_path, capsys, target, said):
    run = tmp_path / "run"
    (run / "featcal-ta").mkdir(parents=True)
    (run / "run_config.json").write_text("{}")
    model = tmp_path / "model"
    shutil.copytree(world["root"] / "experts" / world["tasks"][0], model)
    dataset = next((world["root"] / "data" / world["tasks"][0]).rglob("*.parquet"))
    (tmp_path / "notes.txt").write_text("mine")
    path = {
        "model": model / "model.safetensors", "base": world["root"] / "base" / "config.json",
        "tasks": world["tasks_file"], "dataset": dataset, "stage": run / "featcal-ta" / "metrics.json",
        "run_config": run / "run_config.json", "other": tmp_path / "notes.txt",
    }[target]  # fmt: skip
    before = path.read_bytes() if path.is_file() else None
    argv = ["evaluate", "--model", str(model), "--tasks-file", str(world["tasks_file"]), *CPU, "--output", str(path)]
    code, err = run_error(capsys, argv)
    assert code == 2 and len(err) == 1 and said in err[0] and str(path) in err[0]
    assert (path.read_bytes() if path.is_file() else None) == before


def test_evaluate_writes_into_a_run_s_evaluations_folder(world, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.json").write_text("{}")
    model = tmp_path / "model"
    shutil.copytree(world["root"] / "experts" / world["tasks"][0], model)
    out = run / "evaluations" / "other.json"
    argv = ["-q", "evaluate", "--model", str(model), "--tasks-file", str(world["tasks_file"]), *CPU]
    assert main([*argv, "--eval-num-workers", "0", "--output", str(out)]) == 0
    report = json.loads(out.read_text())
    assert "average" in report and report["weights_sha256"].keys() == {"model.safetensors"}
    assert main([*argv, "--eval-num-workers", "0", "--output", str(out)]) == 0  # its own report: replaced
    assert not (run / ".featcal.lock").exists()


@pytest.mark.parametrize("failure", ["too-long", "read-only"])
def test_an_unwritable_output_is_one_line_naming_the_whole_path(world, tmp_path, capsys, monkeypatch, failure):
    out = tmp_path / ("x" * 300 if failure == "too-long" else "run")
    if failure == "read-only":  # the run's first write, its lock file, meets a read-only file system
        import errno

        from featcal.runfolder.lock import RunLock

        def read_only(self):
            raise OSError(errno.EROFS, "Read-only file system", str(out / ".featcal.lock"))

        monkeypatch.setattr(RunLock, "__enter__", read_only)
    argv = ["run", "--tasks-file", str(world["tasks_file"]), "--output-dir", str(out), *CPU]
    code, err = run_error(capsys, [*argv, "--num-calibration-examples", "8"])
    assert code == 2 and len(err) == 1
    expected = "longer than the system allows" if failure == "too-long" else "The file system is read-only"
    assert expected in err[0] and str(tmp_path) in err[0]


@pytest.mark.parametrize("where", ["the mount point", "a new folder on it"])
def test_a_card_on_a_read_only_file_system_is_one_line_naming_the_path(tmp_path, capsys, monkeypatch, where):
    run = make_run(tmp_path)[0]
    before = tree(run)
    mount = tmp_path / "mnt"
    mount.mkdir()
    out = mount if where == "the mount point" else mount / "card"
    make_read_only(monkeypatch, mount)
    capsys.readouterr()  # the run's building
    code, err = run_error(capsys, ["card", str(run), "--output", str(out)])
    assert code == 2 and len(err) == 1
    assert "The file system is read-only" in err[0] and f"Cannot write or read {out}" in err[0]
    assert not any(mount.iterdir())  # nothing half-written: no plot, no card, no temporary
    assert tree(run) == before and not (run / ".featcal.lock").exists()


def test_sweep_refuses_a_file_where_its_folder_goes(tmp_path, capsys):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "sweep").write_text("mine")
    code, err = run_error(capsys, ["sweep", str(tmp_path / "run")])
    assert code == 2 and len(err) == 1 and "is a file" in err[0]
    assert (tmp_path / "run" / "sweep").read_text() == "mine"


# --- damaged or incomplete model folders --------------------------------------------------------------


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_a_damaged_expert_file_is_one_line(world, tmp_path, capsys, damage):
    root = copy_world(world, tmp_path)
    path = root / "experts" / world["tasks"][1] / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x07" * 4096, "empty": b""}[damage])
    code, err = run_error(
        capsys, ["merge", "--tasks-file", str(root / "tasks.json"), "--output", str(tmp_path / "m"), *CPU]
    )
    assert code == 2 and len(err) == 1
    assert str(path) in err[0] and "not a readable safetensors file" in err[0]
    assert not (tmp_path / "m").exists()


def test_a_shard_index_naming_a_missing_shard_is_one_line(world, tmp_path, capsys):
    root = copy_world(world, tmp_path)
    folder = root / "experts" / world["tasks"][0]
    (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
    names = {"vision_model.a": "model-00001-of-00002.safetensors", "vision_model.b": "model-00002-of-00002.safetensors"}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))
    argv = ["merge", "--tasks-file", str(root / "tasks.json"), "--output", str(tmp_path / "m"), *CPU]
    code, err = run_error(capsys, argv)
    assert code == 2 and len(err) == 1 and "model-00002-of-00002.safetensors" in err[0] and "missing" in err[0]


def test_a_shard_index_naming_a_pickle_is_refused_unread(world, tmp_path, capsys):
    root = copy_world(world, tmp_path)
    folder = root / "experts" / world["tasks"][0]
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model-00001-of-00001.bin").write_bytes(b"never unpickled")
    index = {"weight_map": {"vision_model.post_layernorm.weight": "pytorch_model-00001-of-00001.bin"}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    code, err = run_error(
        capsys, ["merge", "--tasks-file", str(root / "tasks.json"), "--output", str(tmp_path / "m"), *CPU]
    )
    assert code == 2 and len(err) == 1 and "never loads pickles" in err[0]


def test_a_merged_folder_with_a_broken_config_is_one_line(world, tmp_path, capsys):
    common = ["--tasks-file", str(world["tasks_file"]), *CPU]
    assert main(["-q", "merge", "--output", str(tmp_path / "m"), *common]) == 0
    (tmp_path / "m" / "config.json").write_text("{")
    code, err = run_error(
        capsys, ["evaluate", "--model", str(tmp_path / "m"), *common, "--output", str(tmp_path / "x.json")]
    )
    assert code == 2 and len(err) == 1 and "config.json is not readable JSON" in err[0]
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "bert"}))
    code, err = run_error(
        capsys, ["evaluate", "--model", str(tmp_path / "m"), *common, "--output", str(tmp_path / "x.json")]
    )
    assert code == 2 and len(err) == 1 and "'bert'" in err[0]
    assert not (tmp_path / "x.json").exists()


def test_a_base_without_tokenizer_files_is_refused(world, tmp_path, capsys):
    root = copy_world(world, tmp_path)
    for name in ("tokenizer.json", "vocab.json", "merges.txt"):
        (root / "base" / name).unlink(missing_ok=True)
    code, err = run_error(capsys, ["evaluate", "--tasks-file", str(root / "tasks.json"), *CPU])
    assert code == 2 and len(err) == 1 and "has no tokenizer" in err[0]


# --- inputs that would give a wrong answer ------------------------------------------------------------


def test_a_task_named_twice_is_refused(world, tmp_path, capsys):
    task = world["tasks"][0]
    argv = ["merge", "--tasks-file", str(world["tasks_file"]), "--tasks", task, task, "--output", str(tmp_path / "m")]
    code, err = run_error(capsys, [*argv, *CPU])
    assert code == 2 and len(err) == 1 and "--tasks" in err[0] and "each task named once" in err[0]
    assert not (tmp_path / "m").exists()


def test_a_float32_output_dtype_is_refused_for_clip_before_any_work(world, tmp_path, capsys):
    """CLIP vision towers are written in float32 always: asking for it is a language-model option misused,
    refused in one line by merge, calibrate and run, with nothing written; ``base`` is accepted."""
    common = ["--tasks-file", str(world["tasks_file"]), *CPU]
    assert main(["-q", "merge", "--output", str(tmp_path / "m"), *common, "--output-dtype", "base"]) == 0
    recipe = json.loads((tmp_path / "m" / "featcal_recipe.json").read_text())
    assert "output_dtype" not in recipe  # the default is not recorded: the recipe is as before the option
    for argv in (
        ["merge", "--output", str(tmp_path / "m2")],
        ["calibrate", "--merged", str(tmp_path / "m"), "--output", str(tmp_path / "c")],
        ["run", "--output-dir", str(tmp_path / "r")],
    ):
        code, err = run_error(capsys, [*argv, *common, "--output-dtype", "float32"])
        assert code == 2 and len(err) == 1, (argv, err)
        assert "--output-dtype 'float32' is invalid" in err[0] and "CLIP vision tower" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]


def test_ta_model_path_without_skip_ta_is_refused(world, tmp_path, capsys):
    argv = ["run", "--tasks-file", str(world["tasks_file"]), "--ta-model-path", str(tmp_path), *CPU]
    code, err = run_error(capsys, [*argv, "--output-dir", str(tmp_path / "o")])
    assert code == 2 and len(err) == 1 and "--skip-ta" in err[0]
    assert not (tmp_path / "o").exists()


def test_calibrate_asks_for_the_flag_before_using_fewer_images(world, tmp_path, capsys):
    common = ["--tasks-file", str(world["tasks_file"]), *CPU]
    assert main(["-q", "merge", "--output", str(tmp_path / "m"), *common]) == 0
    argv = ["calibrate", "--merged", str(tmp_path / "m"), "--output", str(tmp_path / "c"), *common]
    code, err = run_error(capsys, [*argv, "--num-calibration-examples", "100000"])
    assert code == 2 and len(err) == 1 and "--allow-fewer-calibration-examples" in err[0]
    assert not (tmp_path / "c").exists()


# --- what errors never show ---------------------------------------------------------------------------


def test_hide_secrets_masks_tokens_bearers_and_url_passwords():
    token = "hf_" + "aB3" * 11 + "x"  # the shape of a Hub token: hf_ and 34 letters and digits
    message = (
        "502 from https://user:s3cret@hub.example/api (upstream said: Bearer abc.def; "
        f"token my-own-token-value; {token}) for /data/hf_checkpoints/model.safetensors"
    )
    hidden = hide_secrets(message, ["my-own-token-value", None, ""])
    for secret in ("s3cret", "abc.def", "my-own-token-value", token):
        assert secret not in hidden
    assert "https://***@hub.example/api" in hidden and "Bearer ***" in hidden
    assert hidden.endswith("for /data/hf_checkpoints/model.safetensors")  # paths are not tokens


def test_an_error_echoing_the_token_does_not_print_it(monkeypatch, capsys):
    import featcal.cli.pipeline_commands as commands

    def echo(args):
        raise FeatcalError("The Hub answered 502: upstream failed for tok-from-the-environment-42")

    monkeypatch.setenv("HF_TOKEN", "tok-from-the-environment-42")
    monkeypatch.setattr(commands, "cmd_methods", echo)  # the parser is built, and binds it, in main()
    code, err = run_error(capsys, ["methods"])
    assert code == 2 and err == ["featcal: error: The Hub answered 502: upstream failed for ***"]


def test_a_permission_error_is_one_line_with_status_2(world, tmp_path, capsys, monkeypatch):
    from featcal.families.clip_vision import folders

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_path / "m"))

    monkeypatch.setattr(folders, "save_vision_model", refuse)
    code, err = run_error(
        capsys, ["merge", "--tasks-file", str(world["tasks_file"]), "--output", str(tmp_path / "m"), *CPU]
    )
    assert code == 2 and len(err) == 1
    expected = f"Cannot write or read {tmp_path / 'm'}: Permission denied. Check the path and its permissions."
    assert err[0] == f"featcal: error: {expected}"


def test_a_file_refused_under_a_relative_name_is_named_with_its_whole_path(world, tmp_path, capsys, monkeypatch):
    """`--output-dir run` from tmp_path: the system refuses the run's first file, which the run opens by its
    relative name, run/.featcal.lock (as the issue's `Cannot write or read metrics.json` named a file alone)."""
    import errno
    import os

    real_open = os.open

    def refuse_the_lock(path, flags, *args, **kwargs):  # EPERM as the system raises it: the name as opened
        if os.path.basename(path) == ".featcal.lock":
            raise PermissionError(errno.EPERM, os.strerror(errno.EPERM), os.fsdecode(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(os, "open", refuse_the_lock)
    argv = ["run", "--tasks-file", str(world["tasks_file"]), "--output-dir", "run", *CPU]
    code, err = run_error(capsys, [*argv, "--num-calibration-examples", "8"])
    assert code == 2 and len(err) == 1
    assert f"Cannot write or read {tmp_path / 'run' / '.featcal.lock'}: Operation not permitted." in err[0]


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--threads", "-2"], "--threads '-2' is invalid"),
        (["--zoo-seed", "-1"], "--zoo-seed '-1' is invalid"),
        (["--ta-scaling-factor", "nan"], "--ta-scaling-factor 'nan' is invalid"),
        (["--device", "tpu"], "--device 'tpu' is invalid"),
    ],
)
def test_demo_checks_its_options_before_building_the_zoo(tmp_path, capsys, monkeypatch, option, said):
    import featcal.demo

    built = []
    monkeypatch.setattr(featcal.demo, "build_zoo", lambda *a, **k: built.append(a))
    code, err = run_error(capsys, ["demo", "--tiny", "--output-dir", str(tmp_path / "o"), *option])
    assert code == 2 and len(err) == 1 and said in err[0]
    assert built == [] and not (tmp_path / "o").exists()


def test_demo_refuses_an_output_folder_holding_other_files_before_building_the_zoo(tmp_path, capsys, monkeypatch):
    import featcal.demo

    built = []
    monkeypatch.setattr(featcal.demo, "build_zoo", lambda *a, **k: built.append(a))
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("mine")
    code, err = run_error(capsys, ["demo", "--tiny", "--output-dir", str(tmp_path / "o")])
    assert code == 2 and len(err) == 1 and "notes.txt" in err[0]
    assert built == [] and (tmp_path / "o" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize("option", ["--recipe", "--tasks-file"])
@pytest.mark.parametrize("damage", ["latin-1", "folder", "yaml", "twice", "twice-json"])
def test_a_recipe_or_tasks_file_that_cannot_be_read_is_one_line(tmp_path, capsys, option, damage):
    path = tmp_path / ("input.json" if damage == "twice-json" else "input.yaml")
    if damage == "folder":
        path.mkdir()
    elif damage == "latin-1":
        path.write_bytes("tasks: {caf\xe9: 1}\n".encode("latin-1"))
    elif damage == "twice":  # a parser keeps the last value silently: refused instead
        path.write_text("tasks:\n  a: {dataset: x/y}\n  a: {dataset: x/z}\nseed: 1\n")
    elif damage == "twice-json":
        path.write_text('{"tasks": {"a": {"dataset": "x/y"}, "a": {"dataset": "x/z"}}, "seed": 1}')
    else:
        path.write_text("tasks:\n  a: [1, 2\n  b: 3\n")
    code, err = run_error(capsys, ["run", option, str(path), "--output-dir", str(tmp_path / "o")])
    said = {"latin-1": "is not UTF-8 text", "folder": "is a folder, not a file", "yaml": "is not valid YAML",
            "twice": "key 'a' appears twice in one mapping (lines 2 and 3); keep one",
            "twice-json": "key 'a' appears twice in one object; keep one"}[damage]  # fmt: skip
    assert code == 2 and len(err) == 1 and said in err[0] and str(path) in err[0]
    assert not (tmp_path / "o").exists()


def test_a_recipe_setting_an_option_twice_under_two_spellings_is_refused(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("lambda-ratio: 0.1\nlambda_ratio: 0.2\n")
    code, err = run_error(capsys, ["run", "--recipe", str(recipe), "--output-dir", str(tmp_path / "o")])
    assert code == 2 and err == [f"featcal: error: Recipe {recipe} sets the option 'lambda-ratio' twice: keep one."]
    assert not (tmp_path / "o").exists()


def test_float_labels_are_refused(world, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = copy_world(world, tmp_path)
    task = world["tasks"][0]
    table = json.loads((root / "tasks.json").read_text())
    data = Path(table["tasks"][task]["dataset"]["path"])
    data = data if data.is_absolute() else root / data
    for path in sorted((data / "data").glob("*.parquet")):
        part = pq.read_table(path)
        labels = part.column("label").cast(pa.float64())
        pq.write_table(part.set_column(part.schema.get_field_index("label"), "label", labels), path)
    code, err = run_error(capsys, ["evaluate", "--tasks-file", str(root / "tasks.json"), *CPU])
    assert code == 2 and len(err) == 1 and "class indices must be integers" in err[0] and "double" in err[0]


@pytest.mark.parametrize("pattern", ["{task}{x}", "{task}{0}", "{task}}"])
def test_an_expert_pattern_with_other_fields_is_one_line(world, tmp_path, capsys, pattern):
    argv = ["merge", "--tasks-file", str(world["tasks_file"]), "--expert-model-format", str(tmp_path / pattern)]
    code, err = run_error(capsys, [*argv, "--output", str(tmp_path / "m"), *CPU])
    assert code == 2 and len(err) == 1 and "--expert-model-format" in err[0] and "only field is '{task}'" in err[0]


def test_a_seed_too_large_for_the_generators_is_refused(tmp_path, capsys):
    code, err = run_error(capsys, ["run", "--seed", "99999999999999999999", "--output-dir", str(tmp_path / "o")])
    assert code == 2 and len(err) == 1 and "a whole number in [0, 4294967295]" in err[0]


def test_a_prompt_longer_than_the_text_tower_is_cut_to_its_positions(world):
    from featcal.families.clip_vision.evaluation import ZeroShotClassifier, load_base_clip

    clip, tokenizer, _ = load_base_clip(world["base"])
    positions = clip.config.text_config.max_position_embeddings
    classifier = ZeroShotClassifier(clip, tokenizer)
    long = "a photo of " + "a very " * (4 * positions) + "{}"
    emb = classifier.text_embeddings([long.format("cat"), long.format("dog")])
    assert emb.shape[0] == 2 and bool(emb.isfinite().all())


def test_space_checks_its_address_before_loading_the_model(tmp_path, capsys, monkeypatch):
    import socket

    import featcal.space

    loaded = []
    monkeypatch.setattr(featcal.space, "create_space", lambda *a, **k: loaded.append(a))
    code, err = run_error(capsys, ["space", "--model", str(tmp_path), "--port", "70000"])
    assert code == 2 and len(err) == 1
    assert "--port '70000' is invalid: it must be a whole number in [1, 65535]" in err[0]
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = run_error(capsys, ["space", "--model", str(tmp_path), "--port", str(port)])
    assert code == 2 and len(err) == 1 and f"--port {port}" in err[0] and "choose a free port" in err[0]
    code, err = run_error(capsys, ["space", "--model", str(tmp_path), "--host", "999.1.1.1"])
    assert code == 2 and len(err) == 1 and "--host 999.1.1.1" in err[0]
    assert loaded == []


def test_space_words_a_port_taken_between_the_check_and_the_bind(tmp_path, capsys, monkeypatch):
    import socket
    from types import SimpleNamespace

    import gradio as gr

    import featcal.cli.space
    import featcal.space
    from featcal.space import SpaceSettings
    from featcal.space.ui import Space

    with gr.Blocks() as demo:
        gr.Markdown("A bare page.")
    monkeypatch.setattr(
        featcal.space, "create_space", lambda *a, **k: Space(demo, SimpleNamespace(settings=SpaceSettings()), [])
    )
    monkeypatch.setattr(featcal.cli.space, "_check_address", lambda host, port: None)  # free when it was checked
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = run_error(capsys, ["space", "--model", str(tmp_path), "--port", str(port)])
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"featcal: error: Cannot serve on 127.0.0.1 port {port}: the port is in use")
    assert err[0].endswith("choose a free --port, or stop what holds it.")


def test_an_empty_merge_parameter_value_is_refused(world, tmp_path, capsys):
    argv = ["merge", "--tasks-file", str(world["tasks_file"]), "--merge-param", "scaling_factor="]
    code, err = run_error(capsys, [*argv, "--output", str(tmp_path / "m"), *CPU])
    assert code == 2 and len(err) == 1 and "--merge-param" in err[0]
    assert not (tmp_path / "m").exists()


def test_skip_ta_from_a_folder_inside_the_run_folder_is_refused(world, tmp_path, capsys):
    common = ["--tasks-file", str(world["tasks_file"]), *CPU]
    assert main(["-q", "merge", "--output", str(tmp_path / "run" / "ta"), *common]) == 0
    (tmp_path / "run" / "run_config.json").write_text("{}")  # a run folder holding the merge to start from
    before = tree(tmp_path / "run" / "ta")
    argv = ["run", "--skip-ta", "--ta-model-path", str(tmp_path / "run" / "ta"), "--output-dir", str(tmp_path / "run")]
    code, err = run_error(capsys, [*argv, *common])
    assert code == 2 and len(err) == 1 and "--ta-model-path" in err[0] and "outside the output folder" in err[0]
    assert tree(tmp_path / "run" / "ta") == before


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["run", "--lambda-ratio"], "argument --lambda-ratio: expected one argument (`featcal run --help`"),
        (["methods", "-q"], "unrecognized arguments: -q"),
        (["space", "push"], "required: --repo (`featcal space push --help`"),
    ],
)
def test_an_argument_error_is_one_line(capsys, argv, said):
    with pytest.raises(SystemExit) as stop:
        main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert stop.value.code == 2 and len(err) == 1 and err[0].startswith("featcal: error: ") and said in err[0]


@pytest.mark.parametrize("content", ["empty", "script"])
def test_a_local_dataset_folder_that_does_not_load_is_one_line(world, tmp_path, capsys, content):
    root = copy_world(world, tmp_path)
    table = json.loads((root / "tasks.json").read_text())
    task = world["tasks"][0]
    folder = tmp_path / "not-a-dataset"
    folder.mkdir()
    if content == "script":
        (folder / "not-a-dataset.py").write_text("raise SystemExit('a dataset script must never run')\n")
    table["tasks"][task]["dataset"]["path"] = str(folder)
    (root / "tasks.json").write_text(json.dumps(table))
    code, err = run_error(capsys, ["evaluate", "--tasks-file", str(root / "tasks.json"), *CPU])
    assert code == 2 and len(err) == 1 and f"the dataset folder {folder} does not load" in err[0]
    assert "Hub" not in err[0].split("does not load")[0] and "never runs a dataset script" in err[0]
