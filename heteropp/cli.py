"""``ditorch plan`` and ``ditorch simulate`` (also ``python -m heteropp.cli``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .cluster import GB, ClusterSpec, parse_tokens
from .model_spec import ModelSpec
from .plan import Plan, PlanError
from .search import HeteroAuto, NoFeasiblePlan

from .plan_schedules import SCHEDULES


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="search a HeteroPP plan (HeteroAuto) for a model on a cluster")
    p.add_argument("--cluster", required=True, help="cluster.yaml (chip types, counts, links)")
    p.add_argument("--model", required=True,
                   help="model.yaml (LlamaConfig keys), or a Hugging Face config.json or model directory")
    p.add_argument("--gbs", required=True, help="global batch in tokens, e.g. 2M (= 2 * 2**20)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default: the model's max_seq_len)")
    p.add_argument("--alpha", type=float, default=1.0, help="bubble coefficient (1: 1F1B, 0: zero-bubble)")
    p.add_argument("--one-stage", action="store_true", help="skip the second (sub-group) search stage")
    p.add_argument("--allow-subset", action="store_true",
                   help="plan the subset of chip types that trains fastest, when that is not the whole cluster")
    p.add_argument("--schedule", choices=(*SCHEDULES, "auto"), default="1f1b",
                   help="the schedule the plan runs: jeeves divides the layers for it (memory-aware) and has the "
                        "replicas take turns on the cross-DC link; auto picks jeeves over 1F1B where the plan "
                        "crosses two DCs and the simulator finds it faster")
    p.add_argument("--out", default=None, help="write the plan JSON here")
    p.set_defaults(func=plan_command)

    s = subparsers.add_parser("simulate", help="simulate a plan under a pipeline schedule")
    s.add_argument("plan", help="plan.json written by `ditorch plan`")
    s.add_argument("--schedule", choices=SCHEDULES, default=None, help="default: the plan's")
    s.add_argument("--timeline", default=None, help="write the timeline as a PNG here")
    s.add_argument("--schedule-out", default=None, help="write the per-stage action lists (JSON) here")
    s.add_argument("--schedule-csv", default=None, help="run these action lists (torch.distributed.pipelining's CSV)")
    s.add_argument("--measured", default=None, help="a runtime trace (--trace of ditorch.train) to compare with")
    s.set_defaults(func=simulate_command)


def format_plan(plan: Plan) -> str:
    """The plan as a table: one row per stage."""
    est = plan.estimate
    t = est.get("stage_time_s", [None] * plan.num_stages)
    lines = [
        f"plan: {plan.model.name} on {plan.cluster.name} ({plan.num_chips} chips), "
        f"GBS {plan.global_batch_tokens} tokens = {plan.global_batch_tokens // plan.model.seq} x {plan.model.seq}, "
        f"DP {plan.dp}, {plan.num_microbatches} micro-batches, PP {plan.num_stages}",
        f"{'stage':>5} {'chip':>4} {'ranks':>11} {'TP':>3} {'DP':>3} {'layers':>7} {'range':>9} {'recomp':>6} "
        f"{'memory GB':>15} {'time/mb ms':>10}",
    ]
    for i, s in enumerate(plan.stages):
        cap = plan.cluster.chip(s.chip).usable_memory / GB
        r0, r1 = s.rank_range
        lines.append(
            f"{i:>5} {s.chip:>4} {f'{r0}-{r1 - 1}':>11} {s.tp:>3} {s.dp:>3} {s.layers:>7} "
            f"{f'{s.first_layer}-{s.first_layer + s.layers - 1}':>9} {'yes' if s.recompute else 'no':>6} "
            f"{f'{plan.stage_memory(i) / GB:.1f}/{cap:.1f}':>15} {(t[i] or 0) * 1e3:>10.1f}"
        )
    lines.insert(1, f"schedule {plan.schedule}")
    if "iteration_time_s" in est:
        lines.append(
            f"estimated iteration {est['iteration_time_s']:.3f} s, {est['tokens_per_chip_per_s']:.1f} tokens/chip/s; "
            f"search {est.get('search_seconds', 0):.3f} s ({est.get('search_leaves', 0)} configurations evaluated)"
        )
    return "\n".join(lines)


def format_expectation(exp) -> str:
    """Each chip group alone beside the whole cluster, and the HeteroSpeedupRatio expected."""
    from .hsr import throughput

    lines = [f"{'alone':>8} {'chips':>6} {'iteration s':>12} {'tokens/s':>12}"]
    for name, plan in exp.alone.items():
        if plan is None:
            lines.append(f"{name:>8} {'':>6} {'cannot hold the model alone':>25}")
        else:
            lines.append(f"{name:>8} {plan.num_chips:>6} {plan.estimate['iteration_time_s']:>12.4f} "
                         f"{throughput(plan):>12.1f}")
    lines.append(f"{'together':>8} {exp.whole.num_chips:>6} {exp.whole.estimate['iteration_time_s']:>12.4f} "
                 f"{throughput(exp.whole):>12.1f}")
    lines.append(f"expected HeteroSpeedupRatio (constant batch): {100 * exp.ratio:.1f}% of the groups' throughputs "
                 "summed")
    faster = exp.faster_groups()
    if faster:
        lines.append(f"note: chip group(s) {', '.join(faster)} alone would train faster than the whole cluster; "
                     "--allow-subset plans the fastest subset of chip types")
    return "\n".join(lines)


def emulation_note(plan: Plan, cores: int | None = None) -> str | None:
    """A warning when the plan's emulated chips, all on this host, would outnumber its cores by
    more than the time scale they were profiled at: their host work would then surely not fit in
    their emulated time, and the run would be slower than the plan says. (A scale above that
    may still be too small; the run reports how far its host fell behind, docs/device.md.)"""
    import os

    profiled = plan.cluster.emulated_time_scale
    cores = cores or os.cpu_count() or 1
    if profiled is None or plan.num_chips <= cores * profiled:
        return None
    return (f"note: the chips were profiled at emulation time scale {profiled:g}, but {plan.num_chips} emulated ranks "
            f"on this host's {cores} cores need more than {plan.num_chips / cores:g} times what one rank needs to "
            f"run as fast as planned; profile with --ranks {plan.num_chips} (the time scale is then chosen for "
            f"{plan.num_chips} ranks on this host)")


def plan_command(args) -> int:
    from .hsr import expected, fastest_subset
    from .plan_schedules import with_schedule

    try:
        model = ModelSpec.load(args.model, seq=args.seq)
        cluster = ClusterSpec.from_yaml(args.cluster)
        gbs = parse_tokens(args.gbs)
        auto = HeteroAuto(model, cluster, gbs, alpha=args.alpha)
        plan = auto.to_plan(auto.search(two_stage=not args.one_stage))
        exp = expected(model, cluster, gbs, args.alpha, plan, two_stage=not args.one_stage)
        if args.allow_subset and exp.faster_groups():
            subset = fastest_subset(model, cluster, gbs, args.alpha, exp, two_stage=not args.one_stage)
            if subset is not None and subset.num_chips < plan.num_chips:
                print(f"planning the fastest subset of chip types: {', '.join(c.name for c in subset.cluster.chips)}")
                plan = subset
        plan = with_schedule(plan, args.schedule)
    except (NoFeasiblePlan, PlanError, ValueError, KeyError, OSError) as exc:
        print(f"ditorch plan: {exc}", file=sys.stderr)
        return 1
    print(format_plan(plan))
    if len(cluster.chips) > 1:
        print(format_expectation(exp))
    note = emulation_note(plan)
    if note:
        print(note)
    if args.out:
        plan.to_json(args.out)
        print(f"wrote {args.out}")
    return 0


def simulate_command(args) -> int:
    import json

    from .measured import read_trace
    from .plan_schedules import plan_schedules, schedule_pipeline
    from .schedule import Schedule
    from .simulator import simulate

    try:
        plan = Plan.from_json(Path(args.plan))
    except (PlanError, OSError) as exc:
        print(f"ditorch simulate: {exc}", file=sys.stderr)
        return 1
    S = plan.num_stages
    args.schedule = args.schedule or plan.schedule
    try:
        if args.schedule_csv:
            schedules = [Schedule.from_csv(args.schedule_csv)]
            pipeline = schedule_pipeline(plan, "1f1b")
        else:
            schedules = plan_schedules(plan, args.schedule)
            pipeline = schedule_pipeline(plan, args.schedule)
            schedules = schedules[:len(pipeline.microbatches)]  # the replicas the pipeline simulates
        measured = read_trace(args.measured, S) if args.measured else None
    except (ValueError, OSError) as exc:
        print(f"ditorch simulate: {exc}", file=sys.stderr)
        return 1
    res = simulate(pipeline, schedules)
    print(f"schedule {args.schedule}: iteration {res.iteration_time:.3f} s "
          f"(cost model {plan.estimate.get('iteration_time_s', float('nan')):.3f} s), "
          f"bubble {100 * res.bubble_fraction:.1f}%, "
          f"{plan.global_batch_tokens / (res.iteration_time * plan.num_chips):.1f} tokens/chip/s")
    if measured is not None:
        print(f"measured: iteration {measured.iteration_time:.3f} s (median of {len(measured.iteration_times) - 1} "
              f"steps after the first), measured/simulated {measured.iteration_time / res.iteration_time:.3f}")
    print(f"{'stage':>5} {'chip':>4} {'busy s':>8} {'peak GB':>8} {'capacity GB':>11}"
          + (f" {'measured busy s':>15} {'measured peak GB':>16}" if measured else ""))
    for i, s in enumerate(plan.stages):
        print(f"{i:>5} {s.chip:>4} {res.stage_busy[i]:>8.3f} {res.stage_peak_memory[i] / GB:>8.3f} "
              f"{plan.cluster.chip(s.chip).usable_memory / GB:>11.3f}"
              + (f" {measured.stage_busy[i]:>15.3f} {measured.stage_peak_bytes[i] / GB:>16.3f}" if measured else ""))
    over = [i for i, s in enumerate(plan.stages) if res.stage_peak_memory[i] > plan.cluster.chip(s.chip).usable_memory]
    if over:
        print(f"warning: stages {over} exceed their chip's usable memory under {args.schedule}")
    if args.timeline:
        from .timeline import plot_measured_vs_simulated, plot_timeline

        labels = [f"{i} {s.chip} tp{s.tp}" for i, s in enumerate(plan.stages)]
        title = f"{plan.cluster.name} {args.schedule}"
        if measured is None:
            plot_timeline(res, args.timeline, title=f"{title}: {res.iteration_time:.2f} s", stage_labels=labels)
        else:
            plot_measured_vs_simulated(res, measured.timeline, measured.iteration_time, args.timeline, labels, title)
        print(f"wrote {args.timeline}")
    if args.schedule_out:
        Path(args.schedule_out).write_text(json.dumps(schedules[0].to_dict() if len(schedules) == 1 else
                                                      [s.to_dict() for s in schedules]) + "\n")
        print(f"wrote {args.schedule_out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m heteropp.cli")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
