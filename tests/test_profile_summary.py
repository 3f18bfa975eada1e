"""`jaxscale profile-summary`'s bad input, each one paragraph with exit status 2: the argument
count, --top < 1 (a negative --top printed every op but the last few), a bucket that cannot be
reached (it was reported as a missing trace); absl's usage errors of every entry point as one
paragraph; hints that name `jaxscale COMMAND`, which exists outside a checkout."""

import inspect
import os
import socket
import subprocess
import sys

import pytest
from absl import app

from child_env import child_env
from jaxscale.errors import exit_on_user_error

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cli(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "jaxscale", "profile-summary", *args], cwd=ROOT,
                          env=child_env(**env), capture_output=True, text=True, timeout=120)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("jaxscale: error:")]
    assert len(errors) == 1 and "USAGE" not in proc.stderr, proc.stderr[-2000:]
    return errors[0]


@pytest.mark.parametrize("args, said", [
    ((), "takes one workdir (or .xplane.pb file), and was given 0 (none)"),
    (("a", "b"), "and was given 2 (a b)"),
    (("a", "--top=-3"), "--top=-3"),
    (("a", "--top=0"), "--top=0"),
])
def test_bad_arguments_are_one_paragraph(args, said):
    assert said in _error_line(_cli(*args))


def test_an_unreachable_bucket_is_said_as_such_not_as_a_missing_trace():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    line = _error_line(_cli("s3://bucket/run", AWS_ENDPOINT_URL_S3=dead))
    assert f"cannot connect to the endpoint {dead}" in line and "No profiler trace" not in line


def test_a_bucket_workdir_says_traces_are_local():
    from jaxscale.observe.profiling import ProfileError, latest_trace
    with pytest.raises(ProfileError, match="traces are written to a local --workdir only"):
        latest_trace("s3://bucket/run")


def test_absl_usage_errors_are_one_paragraph_with_status_2(capsys):
    @exit_on_user_error
    def main(argv):
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    main.__wrapped__.__module__ = "jaxscale.launch.prepare_data"
    with pytest.raises(SystemExit) as e:
        main(["prog", "extra"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("jaxscale: error:") == 1 and "\n" not in err.strip()
    assert ("jaxscale prepare-data takes no positional arguments, and was given 1 (extra)"
            in err)


def test_hints_name_the_installed_command_not_a_checkout_module():
    from jaxscale.lofi import worker
    from jaxscale.observe import profiling
    from jaxscale.weights import legacy
    for module in (profiling, legacy, worker):
        assert "python -m launch" not in inspect.getsource(module), module.__name__
    assert "jaxscale profile-summary" in inspect.getsource(profiling.Profiler.stop)
