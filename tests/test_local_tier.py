"""The local checkpoint tier (issue 44 item 1): frequent saves to a per-process directory beside
the persistent workdir saves; a restart restores the newest step complete on the local tier,
else the persistent one, and says which; a truncated or broken local step is never used; old
local steps are deleted; the resumed run's losses equal an uninterrupted run's."""

import json
import os
import re
import shutil

import pytest

from configs.tiny_lm import get_config
from jaxscale import config as config_lib
from jaxscale.errors import ConfigError, JaxscaleError
from jaxscale.observe.metrics import read_metrics
from jaxscale.train.checkpoint import Checkpointer
from jaxscale.train.local_faults import FAILURES_IN_A_ROW, LocalTierFailed
from jaxscale.train.local_tier import LocalTierHook
from jaxscale.train.loop import prepare, train


class Crash(Exception):
    pass


class CrashAfter:
    """Raises after `step`'s saves (the highest order): the process dying mid-run."""

    order = 500

    def __init__(self, step: int):
        self.step = step

    def after_step(self, info):
        if info.step == self.step:
            raise Crash()

    def at_end(self, info):
        pass


def _config(local: str, steps: int = 8):
    c = get_config("test")
    c.train.update(steps=steps, log_every=1, eval_every=0)
    c.checkpoint.update(every=4, local_dir=local, local_every=1, local_keep=2)
    return c


def _crash_at(config, workdir: str, step: int) -> None:
    """Trains until `step` and stops there as a killed process would, after letting the
    background commits in flight finish (a kill after them)."""
    trainer = prepare(config, workdir, hooks=[CrashAfter(step)])
    with pytest.raises(Crash):
        trainer.run()
    for hook in trainer.hooks:
        if isinstance(hook, LocalTierHook):
            hook.tier.finish()
        elif hasattr(hook, "checkpointer"):
            hook.checkpointer.close()


def _losses(workdir: str) -> list[float]:
    return [r["loss"] for r in read_metrics(workdir)]


def _local_steps(local: str) -> list[str]:
    return sorted(n for n in os.listdir(local) if n.isdigit())


@pytest.fixture
def whole(tiny_losses):
    """An uninterrupted run's losses (no checkpoints, no local tier: it must not change the
    trajectory): conftest's, of these 8 steps, from another process."""
    return tiny_losses


def test_resumes_from_the_newest_local_step_and_matches_an_uninterrupted_run(
        tmp_path, whole, capfd):
    local = str(tmp_path / "local-{process}")
    workdir = str(tmp_path / "run")
    _crash_at(_config(local), workdir, 6)
    assert _local_steps(str(tmp_path / "local-0")) == ["5", "6"]  # local_keep=2: older deleted
    assert Checkpointer(workdir, 4, 3).latest_step() == 4
    capfd.readouterr()
    train(_config(local), workdir)
    out = capfd.readouterr().out
    assert f"resumed from step 6 of the local tier {tmp_path / 'local-0'}" in out
    assert _losses(workdir) == whole


def test_an_empty_local_tier_falls_back_to_the_persistent_step(tmp_path, whole, capfd):
    local, workdir = str(tmp_path / "local"), str(tmp_path / "run")
    _crash_at(_config(local), workdir, 6)
    shutil.rmtree(local)  # a replaced host: its local disk is empty
    capfd.readouterr()
    train(_config(local), workdir)
    out = capfd.readouterr().out
    assert f"resumed from {workdir}/checkpoints/4 (persistent tier; the local tier has no " \
           "step)" in out
    assert _losses(workdir) == whole


def test_an_unfinished_local_step_an_earlier_run_left_is_removed_at_the_start(tmp_path, capfd):
    from jaxscale.train.local_tier import LocalTier

    tier_dir = tmp_path / "tier"
    left = tier_dir / "3.orbax-checkpoint-tmp-1700000000"  # a save cut short by a kill
    (left / "state").mkdir(parents=True)
    (left / "state" / "x").write_bytes(b"0" * 64)
    (tier_dir / "notes.txt").write_text("a user's file stays")
    tier = LocalTier(str(tier_dir), 1, 2)
    assert sorted(os.listdir(tier_dir)) == ["notes.txt"] and tier.steps() == []
    assert "3.orbax-checkpoint-tmp-1700000000" in capfd.readouterr().err


def test_another_runs_local_tier_is_refused_and_left_as_it_was(tmp_path, capfd):
    """A fresh workdir resumes from its local tier's newest step: given another run's tier it
    would start from that run's weights, and its saves would delete that run's steps."""
    local, a, b = (os.path.realpath(tmp_path / name) for name in ("tier", "a", "b"))
    train(_config(local, steps=2), a)
    before = sorted(os.listdir(local))
    with pytest.raises(JaxscaleError, match=re.escape(
            f"holds another run's local tier, on this process ({local} belongs to {a}); this "
            f"run's workdir is {b}.")) as refused:
        train(_config(local, steps=4), b)
    assert "Nothing was restored or deleted" in str(refused.value)
    assert sorted(os.listdir(local)) == before and ".jaxscale-tier-owner.json" in before
    capfd.readouterr()
    train(_config(local, steps=4), a)  # its own run resumes from it
    assert f"resumed from step 2 of the local tier {local}" in capfd.readouterr().out


def test_local_steps_a_fresh_workdir_never_made_are_refused(tmp_path):
    """The workdir deleted and the run started afresh under the same name: its old local steps
    would be resumed from, continuing the deleted run instead of starting this one."""
    local, workdir = str(tmp_path / "tier"), str(tmp_path / "run")
    train(_config(local, steps=2), workdir)
    shutil.rmtree(workdir)
    before = sorted(os.listdir(local))
    with pytest.raises(JaxscaleError, match=re.escape(
            f"holds the local steps of an earlier run, on this process ({local} holds step 2), "
            f"but --workdir={workdir} holds no start of one (no config.json")):
        train(_config(local, steps=4), workdir)
    assert sorted(os.listdir(local)) == before


def test_an_unreadable_owner_record_is_refused_naming_it(tmp_path):
    from jaxscale.train.local_dir import OWNER_FILE, claim

    (tmp_path / OWNER_FILE).write_text("{torn")
    with pytest.raises(JaxscaleError, match=f"an unreadable owner record, {tmp_path}/{OWNER_FILE}"):
        claim(str(tmp_path), str(tmp_path / "run"))
    (tmp_path / OWNER_FILE).unlink()
    claim(str(tmp_path), str(tmp_path / "run"))  # claimed, then its own again
    claim(str(tmp_path), str(tmp_path / "run"))
    recorded = json.loads((tmp_path / OWNER_FILE).read_text())
    assert recorded == {"workdir": os.path.realpath(tmp_path / "run")}


def test_truncated_and_broken_local_steps_are_never_chosen(tmp_path, whole, capfd):
    """A truncated step is never listed; a damaged newest step gives way to the one before."""
    local, workdir = str(tmp_path / "local"), str(tmp_path / "run")
    _crash_at(_config(local), workdir, 6)
    # A save cut short by a kill: orbax's temporary directory, never listed as a step.
    os.makedirs(os.path.join(local, "7.orbax-checkpoint-tmp-1234", "state"))
    # And step 6 damaged after its commit: its array data gone.
    for root, _, files in os.walk(os.path.join(local, "6", "state")):
        for name in files:
            if "ocdbt" in root or name.startswith("d"):
                os.remove(os.path.join(root, name))
    capfd.readouterr()
    train(_config(local), workdir)
    out = capfd.readouterr().out
    assert f"resumed from step 5 of the local tier {local}" in out
    assert _losses(workdir) == whole


class BreakAt:
    """Replaces the tier by a regular file after `step` (before that step's local save)."""

    order = 250

    def __init__(self, directory: str, step: int):
        self.directory, self.step = directory, step

    def after_step(self, info):
        if info.step == self.step:
            os.rename(self.directory, self.directory + ".gone")
            open(self.directory, "w").close()

    def at_end(self, info):
        pass


def test_a_local_tier_failing_three_saves_in_a_row_stops_the_run_and_the_rerun_resumes(
        tmp_path, whole, capfd):
    """One process whose tier becomes a regular file after step 3: the local saves of steps 3,
    4 and 5 fail (or step 2's commit, in flight then, instead of step 3's save), and the third
    failure in a row stops the run with one paragraph, the persistent step 4 kept; with the
    directory back the same command resumes from that step with an uninterrupted run's losses
    (two processes: tests/test_local_tier_faults.py)."""
    local, workdir = str(tmp_path / "local"), str(tmp_path / "run")
    trainer = prepare(_config(local), workdir, hooks=[BreakAt(local, 3)])
    with pytest.raises(LocalTierFailed) as e:
        trainer.run()
    message = str(e.value)
    assert "\n" not in message and message.startswith(
        f"The local checkpoint tier (checkpoint.local_dir) failed {FAILURES_IN_A_ROW} saves in a "
        f"row, the last at step 5, on process 0 ({local}: [Errno 20] Not a directory"), message
    warned = [x for x in capfd.readouterr().out.splitlines() if "warning: the local" in x]
    assert len(warned) == FAILURES_IN_A_ROW - 1
    for hook in trainer.hooks:  # the killed process's commits in flight end with it
        if hasattr(hook, "checkpointer"):
            hook.checkpointer.close()
    os.remove(local)
    train(_config(local), workdir)
    assert f"resumed from {workdir}/checkpoints/4 (persistent tier" in capfd.readouterr().out
    assert _losses(workdir) == whole


@pytest.mark.parametrize("fields, named", [
    (dict(local_dir="/tmp/x", local_every=0), "needs both a directory and an interval"),
    (dict(local_every=5), "needs both a directory and an interval"),
    (dict(local_dir="s3://bucket/x", local_every=5), "is a URL"),
    (dict(local_dir="/tmp/x", local_every=5, local_keep=0), "local_keep=0 >= 1"),
    (dict(local_dir="/tmp/x", local_every_minutes=float("inf")), "local_every_minutes=inf"),
])
def test_local_tier_settings_are_checked_in_one_paragraph(fields, named):
    c = get_config("test")
    c.checkpoint.update(**fields)
    with pytest.raises(ConfigError, match=named) as e:
        config_lib.validate(c)
    assert "\n" not in str(e.value)


def test_another_mesh_restores_the_persistent_step_not_zeros_from_the_local_tier(
        tmp_path, whole, capfd):
    """Each local step records which shards its process holds; a run on another mesh (which
    would read unwritten chunks as zeros) takes the persistent tier instead."""
    local, workdir = str(tmp_path / "local"), str(tmp_path / "run")
    _crash_at(_config(local), workdir, 6)
    c = _config(local)
    c.mesh.update(data=1, fsdp=4, tensor=2)
    capfd.readouterr()
    train(c, workdir)
    out = capfd.readouterr().out
    assert f"resumed from {workdir}/checkpoints/4 (persistent tier; the local tier could " \
           "not restore step 6, 5 on every process" in out
    assert _losses(workdir) == pytest.approx(whole, rel=1e-5)


def test_local_every_minutes_saves_on_the_injected_clock(tmp_path):
    from tests.test_checkpoint_time import Minutes

    local = str(tmp_path / "local")
    c = _config(local)
    c.checkpoint.update(every=0, local_every=0, local_every_minutes=2.5, local_keep=5)
    trainer = prepare(c, str(tmp_path / "run"))
    [hook] = [h for h in trainer.hooks if isinstance(h, LocalTierHook)]
    hook.interval.clock = Minutes()  # step s at minute s-1: 2.5 minutes pass at 4 and 7
    trainer.run()
    assert _local_steps(local) == ["4", "7"]


@pytest.mark.slow
@pytest.mark.xdist_group("seaweedfs")
def test_s3_workdir_with_the_local_tier_on_disk_resumes_from_the_local_step(
        seaweedfs, tmp_path, whole, capfd):
    from jaxscale.storage import locations

    _, bucket = seaweedfs
    locations.configure()
    local, workdir = str(tmp_path / "local"), f"s3://{bucket}/runs/tier"
    _crash_at(_config(local), workdir, 6)
    capfd.readouterr()
    train(_config(local), workdir)
    assert f"resumed from step 6 of the local tier {local}" in capfd.readouterr().out
    assert _losses(workdir) == whole


def test_peers_can_supply_a_replaced_hosts_shards_only_where_the_state_is_replicated():
    """`replica_plan` (the layout rule of `local_peers`): a replica along an axis no leaf is
    sharded over, lying wholly on the processes that hold the step; none where every axis of
    size > 1 shards some leaf (a replaced host's shards were on no other host), or where no
    process holds the step. (One process here; test_local_tier_kill runs two.)"""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from jaxscale.train.local_peers import replica_plan

    mesh = Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))
    replicated = [NamedSharding(mesh, P()), NamedSharding(mesh, P("fsdp", None))]
    assert replica_plan(replicated, {0}) == ((0, 0), "")
    plan, why = replica_plan(replicated, set())
    assert plan is None and "no other host holds" in why
    sharded = [*replicated, NamedSharding(mesh, P(("data", "fsdp")))]
    assert replica_plan(sharded, {0})[0] is None
