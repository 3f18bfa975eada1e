"""The combined progress line of launch.lofi_local comes from metrics.jsonl and the store."""

import io
import json

import numpy as np

from jaxscale.lofi import store as S
from jaxscale.lofi.averager import AveragerConfig, publish_initial, run_round
from jaxscale.lofi.job import Output
from jaxscale.lofi.progress import JobProgress, newest_record
from jaxscale.weights.kv import Store


def _worker(path, steps, records, cut_short=False):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"train": {"steps": steps}}))
    text = "".join(json.dumps(r) + "\n" for r in records)
    (path / "metrics.jsonl").write_text(text + ('{"step": 9, "lo' if cut_short else ""))


def test_progress_line_reads_metrics_files_and_the_newest_round(tmp_path):
    store = str(tmp_path / "store")
    _worker(tmp_path / "w0", 20, [{"step": 1, "loss": 5.0}, {"step": 12, "loss": 3.14159}],
            cut_short=True)  # a record being written is not read half-way
    progress = JobProgress(store, [str(tmp_path / "w0"), str(tmp_path / "w1")])
    assert progress.poll() == "[lofi] w0 12/20 loss=3.1416 | w1 starting | average round -"
    assert progress.poll() is None  # unchanged: nothing to print
    publish_initial(Store(store), {"w": np.zeros(3, np.float32)})
    S.push(store, 0, 12, {"w": np.ones(3, np.float32)}, 12)
    assert run_round(store, AveragerConfig()).round == 1
    _worker(tmp_path / "w1", 20, [{"step": 4, "loss": 2.5, "eval_loss": 2.0}])
    assert progress.poll() == ("[lofi] w0 12/20 loss=3.1416 | w1 4/20 loss=2.5000 | "
                               "average round 1")


def test_only_the_tail_of_a_long_metrics_file_is_read(tmp_path):
    records = [{"step": s, "loss": 1.0 / s} for s in range(1, 20001)]  # over 64 KiB
    _worker(tmp_path / "w0", 20000, records)
    assert (tmp_path / "w0" / "metrics.jsonl").stat().st_size > 1 << 16
    assert newest_record(str(tmp_path / "w0")) == {"step": 20000, "loss": 1.0 / 20000}


def test_printed_text_is_passed_through_never_parsed(tmp_path):
    """A worker printing something that looks like a progress line changes nothing."""
    _worker(tmp_path / "w0", 4, [{"step": 2, "loss": 1.5}])
    out = io.StringIO()
    output = Output(JobProgress(str(tmp_path / "store"), [str(tmp_path / "w0")]), out)
    output.feed("w0", "step 4/4 loss=0.0001 (3s)\n")
    output.feed("avg", "round 7: averaged w0@4\n")
    output.show_progress()
    assert out.getvalue().splitlines() == [
        "[w0] step 4/4 loss=0.0001 (3s)", "[avg] round 7: averaged w0@4",
        "[lofi] w0 2/4 loss=1.5000 | average round -"]
