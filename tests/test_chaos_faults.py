"""Faults round four (issue 44), the fast half of `make chaos`'s checks run in-process:
hostile Hugging Face directories (bench/chaos_hf.py) refused in one paragraph naming the file
and the tensor or field, with nothing written; convert refusing a non-empty target."""

import os

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


def test_convert_cli_refuses_overwrite_without_libtpu_lines(tmp_path):
    """The CLI's side (slow-ish: four `jaxscale convert` processes)."""
    chaos_hf.overwrite_refused(str(tmp_path))


def test_hostile_directory_by_cli(hostile, tmp_path):
    what, path, words = hostile[1]  # a NaN in layer 1: through `convert` and `generate`
    chaos_hf.refused_by_cli(path, words, str(tmp_path / "out"))
    chaos_hf.refused_by_cli(path, words, str(tmp_path / "gen"), generate=True)
