"""The text report of `launch.compile`: memory against HBM, FLOPs, collectives, the estimate."""

from __future__ import annotations

from collections import defaultdict

from jaxscale.aot.compile import StepReport
from jaxscale.aot.roofline import Estimate, estimate
from jaxscale.hardware import TPUS


def _gib(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB"


def step_estimate(report: StepReport) -> Estimate:
    chip = TPUS[report.topology.split(":")[0]]
    return estimate(chip, report.step_flops, report.collectives, report.model_flops,
                    report.int8_flops, report.host_transfer_bytes)


def collective_table(collectives: list[dict]) -> list[str]:
    """One line per (kind, link): ops, executions per step, bytes per chip per step."""
    rows: dict[tuple, list[int]] = defaultdict(lambda: [0, 0, 0, 0])
    for c in collectives:
        r = rows[(c["kind"], "DCN" if c["dcn"] else "ICI")]
        r[0] += 1
        r[1] += c["executions"]
        r[2] += c["bytes"] * c["executions"]
        r[3] += c["in_loop"]
    lines = [f"  {'kind':<20} {'link':<4} {'ops':>5} {'runs/step':>10} {'per chip/step':>16}"
             f" {'in loops':>9}"]
    for (kind, link), (ops, runs, nbytes, looped) in sorted(rows.items()):
        lines.append(f"  {kind:<20} {link:<4} {ops:>5} {runs:>10} {_gib(nbytes):>16} {looped:>9}")
    return lines


def expected_lines(report: StepReport) -> list[str]:
    """Each kind with an analytic expectation (`aot.traffic`: the MoE token dispatch) against
    what the table has of that kind."""
    lines = []
    for kind, expected in sorted(report.expected_collectives.items()):
        compiled = sum(c["bytes"] * c["executions"] for c in report.collectives
                       if c["kind"] == kind)
        ratio = f": compiled / expected = {compiled / expected:.2f}" if expected else ""
        lines.append(f"  {kind} expected {_gib(expected)} per chip/step (MoE token dispatch, "
                     f"analytic), compiled {_gib(compiled)}{ratio}")
    return lines


def traffic_lines(report: StepReport) -> list[str]:
    """Attention's expected bytes across sequence shards (`aot.traffic`) next to the compiled
    totals of the same collective kinds (which also hold FSDP's gathers, scatters and
    windowed-einsum permutes)."""
    t = report.attention_traffic
    if not t:
        return []
    compiled = defaultdict(int)
    for c in report.collectives:
        compiled[c["kind"]] += c["bytes"] * c["executions"]
    kinds = dict.fromkeys((t["forward_kind"], t["backward_kind"]))
    expected = defaultdict(float)
    expected[t["forward_kind"]] += t["forward"]
    expected[t["backward_kind"]] += t["backward"]
    return [f"attention across {t['shards']} sequence shards ({t['variant']}): ANALYTIC "
            f"{_gib(t['forward'])} forward (remat's recompute included) + "
            f"{_gib(t['backward'])} backward per chip/step; "
            f"K/V block {_gib(t['kv_block_bytes'])}"] + [
        f"  {kind}: expected {_gib(expected[kind])}, compiled {_gib(compiled[kind])}"
        for kind in kinds]


def host_lines(r: StepReport) -> list[str]:
    """Pinned host memory, apart from HBM (offloaded activations and optimizer state), and what
    crosses PCIe for it each step."""
    if not (r.host_temp_bytes or r.host_argument_bytes or r.host_output_bytes):
        return []
    to_device, to_host = r.host_transfer_bytes
    return [f"  pinned host memory (not HBM): temporaries {_gib(r.host_temp_bytes)}, arguments "
            f"{_gib(r.host_argument_bytes)}, outputs {_gib(r.host_output_bytes)}; over PCIe "
            f"per step {_gib(to_device)} to the chip, {_gib(to_host)} back"]


def format_report(report: StepReport) -> str:
    r, est = report, step_estimate(report)
    limit = r.hbm_limit_bytes or r.hbm_bytes
    verdict = "fits" if r.fits else f"DOES NOT FIT: over by {_gib(r.total_bytes - limit)}"
    usable = (f" (libtpu lets a program use {_gib(limit)})" if limit != r.hbm_bytes else "")
    mesh = " ".join(f"{k}={v}" for k, v in r.mesh.items())
    lines = [
        f"topology {r.topology}: {r.num_chips} chips, mesh {mesh}; compiled in "
        f"{r.compile_s:.1f} s",
        "memory per chip (TPU compiler):",
        f"  arguments {_gib(r.argument_bytes)}, outputs {_gib(r.output_bytes)} "
        f"({_gib(r.alias_bytes)} aliased to arguments), temporaries {_gib(r.temp_bytes)}",
        f"  total {_gib(r.total_bytes)} of {_gib(r.hbm_bytes)} HBM{usable}: {verdict}",
        *host_lines(r),
        f"FLOPs per chip per step: {r.flops:.3e} compiled (matmuls, loops x trip counts; "
        f"cost analysis, loop bodies once: {r.flops_cost_analysis:.3e})",
    ]
    if r.kernel_calls:
        lines.append(
            f"  of which {r.kernel_flops:.3e} ANALYTIC for {r.kernel_calls} Pallas kernel calls "
            "(splash attention: custom calls carry no dot to count; counted as einsum attention "
            "would compute them)" if r.kernel_flops else
            f"  NOT counted: {r.kernel_calls} Pallas kernel calls (custom calls carry no dot to "
            "count); FLOPs and MFU below miss their share")
    if r.grouped_flops:
        lines.append(
            f"  of which {r.grouped_flops:.3e} in grouped matmuls (dropless MoE) at their static "
            f"rows, an upper bound; at the routed rows (ANALYTIC) {r.routed_flops:.3e}, so the "
            f"step computes {r.step_flops:.3e}, the count the estimate charges")
    if r.int8_flops:
        lines.append(f"  of which {r.int8_flops:.3e} in int8 matmuls (precision=int8), at the "
                     "chip's int8 peak in the estimate: datasheet rate, an ESTIMATE until a TPU "
                     "runs it")
    if r.model_flops:
        lines.append(f"  analytic model FLOPs {r.model_flops:.3e} per chip: compiled / model = "
                     f"{r.step_flops / r.model_flops:.2f}")
    if r.model_flops and r.expected_flops:
        padding = (f", of which {r.padding_flops:.3e} on MoE expert buffers' empty slots"
                   if r.padding_flops else "")
        lines.append(f"  model + remat recompute{' + padding' if padding else ''} "
                     f"{r.expected_flops:.3e} (remat factor "
                     f"{r.expected_flops / r.model_flops:.2f}{padding}): compiled / expected = "
                     f"{r.step_flops / r.expected_flops:.2f} ("
                     + ("the grouped matmuls at the routed rows; " if r.grouped_flops else "")
                     + "above 1: pipeline bubbles, duplicated compute)")
    lines += ["collectives per chip per step (TPU compiler):"] + collective_table(r.collectives)
    lines += expected_lines(r)
    lines += traffic_lines(r)
    lines += [
        "step time ESTIMATE (roofline: peak compute, ring collectives at link bandwidth; not a"
        " measurement):",
        f"  compute {est.compute_s * 1e3:,.1f} ms, ICI {est.ici_s * 1e3:,.1f} ms, DCN "
        f"{est.dcn_s * 1e3:,.1f} ms" + (f", host (PCIe) {est.host_s * 1e3:,.1f} ms"
                                        if est.host_s else ""),
        f"  step {est.full_overlap_s * 1e3:,.1f} ms (full overlap) .. "
        f"{est.no_overlap_s * 1e3:,.1f} ms (no overlap)" + (
            f"; MFU {est.mfu_full_overlap:.0%} .. {est.mfu_no_overlap:.0%}"
            if est.mfu_no_overlap else ""),
    ]
    return "\n".join(lines)
