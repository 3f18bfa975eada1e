"""Faults round four (issue 44), the fast half of `make chaos`'s checks run in-process:
hostile Hugging Face directories (bench/chaos_hf.py) refused in one paragraph naming the file
and the tensor or field, with nothing written; convert refusing a non-empty target."""

import json
import os
import time

import pytest

from bench import chaos_hf


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    return chaos_hf.hostile_dirs(str(tmp_path_factory.mktemp("hostile")))


@pytest.mark.parametrize("case", range(len(chaos_hf.HOSTILE)),
                         ids=[h[0] for h in chaos_hf.HOSTILE])
def test_hostile_hf_directory_is_one_paragraph_and_nothing_written(hostile, case, tmp_path):
    what, path, words = hostile[case]
    chaos_hf.refused_in_process(path, words, str(tmp_path / "out"))


def test_a_clean_directory_still_converts(hostile, tmp_path):
    from jaxscale.interop import convert
    clean = os.path.join(os.path.dirname(hostile[0][1]), "clean-mixtral")
    assert convert.hf_to_workdir(clean, str(tmp_path / "out"))["moe"]["num_experts"] == 4


def test_convert_refuses_a_non_empty_target_unless_overwrite(hostile, tmp_path):
    from jaxscale.errors import JaxscaleError
    from jaxscale.interop import convert

    clean = os.path.join(os.path.dirname(hostile[0][1]), "clean-llama")
    out, export = tmp_path / "out", tmp_path / "export"
    for d, name in ((out, "model_config.json"), (export, "config.json")):
        d.mkdir()
        (d / name).write_text("mine")
    with pytest.raises(JaxscaleError, match="not empty.*--overwrite"):
        convert.hf_to_workdir(clean, str(out))
    assert (out / "model_config.json").read_text() == "mine" and len(os.listdir(out)) == 1
    convert.hf_to_workdir(clean, str(out), overwrite=True)
    with pytest.raises(JaxscaleError, match="not empty.*--overwrite"):
        convert.workdir_to_hf(str(out), str(export))
    assert (export / "config.json").read_text() == "mine" and len(os.listdir(export)) == 1
    convert.workdir_to_hf(str(out), str(export), overwrite=True)
    assert (export / "model.safetensors").exists()
    with pytest.raises(JaxscaleError, match="regular file"):
        convert.workdir_to_hf(str(out), str(export / "config.json" / "x"))
    with pytest.raises(JaxscaleError, match="is the --from_workdir itself"):
        convert.workdir_to_hf(str(out), str(out), overwrite=True)
    assert (out / "model_config.json").exists() and not (out / "config.json").exists()


def test_convert_cli_refuses_overwrite_without_libtpu_lines(tmp_path):
    """The CLI's side (slow-ish: four `jaxscale convert` processes)."""
    chaos_hf.overwrite_refused(str(tmp_path))


def test_hostile_directory_by_cli(hostile, tmp_path):
    what, path, words = hostile[1]  # a NaN in layer 1: through `convert` and `generate`
    chaos_hf.refused_by_cli(path, words, str(tmp_path / "out"))
    chaos_hf.refused_by_cli(path, words, str(tmp_path / "gen"), generate=True)


def _workdir_with_checkpoint(tmp_path, config) -> str:
    from jaxscale import config as config_lib
    workdir = str(tmp_path / "run")
    config_lib.save_config(config, workdir)
    os.makedirs(os.path.join(workdir, "checkpoints", "2"))
    return workdir


def test_a_resume_with_changed_model_fields_names_them_and_refuses(tmp_path):
    from jaxscale.configs import mixtral
    from jaxscale.errors import ConfigError
    from jaxscale.train.resume_config import RESUME_SAFE, check_resumed_model

    config = mixtral.get_config()
    workdir = _workdir_with_checkpoint(tmp_path, config)
    before = open(os.path.join(workdir, "config.json")).read()
    for field, value in (("experts_per_token", 1), ("num_experts", 2)):
        changed = mixtral.get_config()
        changed.model.moe[field] = value
        with pytest.raises(ConfigError, match=f"model.moe.{field}: saved .*, now {value}"):
            check_resumed_model(changed, workdir)
    safe = mixtral.get_config()
    safe.model.moe.capacity_factor, safe.model.remat = 1.5, "full"
    assert {"moe.capacity_factor", "remat"} <= set(RESUME_SAFE)
    check_resumed_model(safe, workdir)  # documented safe: resumes
    check_resumed_model(config, workdir)
    assert open(os.path.join(workdir, "config.json")).read() == before
    os.rmdir(os.path.join(workdir, "checkpoints", "2"))  # nothing saved yet: a fresh start
    changed.model.moe.num_experts = 2
    check_resumed_model(changed, workdir)


def test_moe_capacity_factor_must_be_finite():
    from jaxscale import config as config_lib
    from jaxscale.configs import mixtral
    from jaxscale.errors import ConfigError

    config = mixtral.get_config()
    for bad in (float("inf"), float("nan"), -1.0):
        config.model.moe.capacity_factor = bad
        with pytest.raises(ConfigError, match="capacity_factor"):
            config_lib.validate(config)


def test_heavy_moe_drops_warn_once_on_the_console():
    import io

    from jaxscale.observe.progress import DROPPED_WARN, ProgressBar

    out = io.StringIO()
    bar = ProgressBar(10, stream=out, print_every=1)
    bar.update(1, {"loss": 1.0, "moe_dropped": DROPPED_WARN / 2})
    assert "warning" not in out.getvalue()
    for step in (2, 3):
        bar.update(step, {"loss": 1.0, "moe_dropped": 0.6})
    text = out.getvalue()
    assert text.count("jaxscale: warning: step 2 dropped 60%") == 1, text
    assert "capacity_factor" in text and text.count("warning") == 1


def test_a_bad_plan_cache_entry_is_a_note_and_compiled_again(tmp_path, capsys):
    from jaxscale.aot.search import read_cached

    good = {"total_bytes": 1, "hbm_bytes": 2, "estimate": {"no_overlap_s": 1.0,
                                                           "full_overlap_s": 0.5}}
    for name, text in (("cut.json", json.dumps(good)[:30]), ("list.json", "[1, 2]"),
                       ("shape.json", json.dumps({"total_bytes": 1, "estimate": 3})),
                       ("ok.json", json.dumps(good)), ("error.json", '{"error": "x"}')):
        (tmp_path / name).write_text(text)
    assert read_cached(str(tmp_path / "ok.json")) == good
    assert read_cached(str(tmp_path / "error.json")) == {"error": "x"}
    capsys.readouterr()
    for name in ("cut.json", "list.json", "shape.json"):
        assert read_cached(str(tmp_path / name)) is None
    notes = capsys.readouterr().err.strip().split("\n")
    assert len(notes) == 3 and all(n.startswith("jaxscale: note: plan cache entry") for n in notes)


def test_plan_and_compile_flags_are_checked_before_compiling(tmp_path):
    from jaxscale.aot.search import check_cache_dir, check_margin
    from jaxscale.errors import JaxscaleError
    from jaxscale.launch.compile import check_out

    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for margin in (-0.1, 1.0, 2.0, float("nan")):
        with pytest.raises(JaxscaleError, match="--hbm_margin"):
            check_margin(margin)
    check_margin(0.0)
    with pytest.raises(JaxscaleError, match="--cache_dir=.*regular file"):
        check_cache_dir(str(a_file / "cache"))
    check_cache_dir(str(tmp_path / "cache"))
    with pytest.raises(JaxscaleError, match="--out=.*regular file"):
        check_out(str(a_file / "x"))
    check_out(str(tmp_path / "report.json"))


def test_sigterm_stops_the_plans_workers_and_leaves_whole_entries(tmp_path):
    import multiprocessing
    import signal
    import threading

    from bench.chaos_plan import slow_compile
    from jaxscale.aot.search import PlanStopped, search
    from jaxscale.aot.topology import parse_topology
    from jaxscale.configs import llama

    def stop(signum, frame):
        raise PlanStopped("SIGTERM")

    cache = tmp_path / "cache"
    cache.mkdir()
    seen: list = []

    def terminate_once_compiling():
        deadline = time.monotonic() + 120
        while len(seen) < 2 and time.monotonic() < deadline:  # both workers mid-"compile"
            time.sleep(0.1)
            seen[:] = os.listdir(cache)
        os.kill(os.getpid(), signal.SIGTERM)

    previous = signal.signal(signal.SIGTERM, stop)
    timer = threading.Thread(target=terminate_once_compiling, daemon=True)
    try:
        timer.start()
        with pytest.raises(PlanStopped):
            search(llama.get_config("tiny"), parse_topology("v5p:2x2x1"), str(cache),
                   max_candidates=2, workers=2, compile_fn=slow_compile)
    finally:
        timer.join()
        signal.signal(signal.SIGTERM, previous)
    assert len(seen) == 2, seen
    assert not multiprocessing.active_children()
    assert os.listdir(cache) == []  # the workers' partial entries are removed


@pytest.mark.parametrize("family", sorted(chaos_hf.FAMILIES))
def test_every_config_field_with_a_bad_value_is_read_or_one_paragraph(family, tmp_path):
    chaos_hf.fuzz_config(str(tmp_path), family)
