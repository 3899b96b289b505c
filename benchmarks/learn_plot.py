"""The held-out pass rate of several `trajproxy train` seeds: a figure and the numbers (benchmarks/RESULTS.md, §37).

    python benchmarks/learn_plot.py trajproxy-train/seed-*/summary.json --plot docs/learn-pass-rate.png

Reads each run's summary (its `evaluations`: the held-out pass rate at step 0 and later), prints each seed's pass
rate per evaluated step, their mean, the seeds' spread (max - min) and a 95% interval of the mean gain from step 0 to
the last step (Student's t over the seeds' gains), and draws each seed and their mean.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

# Student's t, two-sided 95%, by degrees of freedom (the seeds less one)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def curves(paths: list[Path]) -> dict[str, dict[int, float]]:
    """Each run's pass rate by evaluated step, named by its seed."""
    found = {}
    for path in paths:
        summary = json.loads(path.read_text())
        seed = summary["arguments"]["seed"]
        found[f"seed {seed}"] = {e["step"]: e["pass_rate"] for e in summary["evaluations"]}
    return found


def report(runs: dict[str, dict[int, float]]) -> list[str]:
    steps = sorted(set.intersection(*(set(points) for points in runs.values())))
    lines = ["step  " + "  ".join(f"{name:>7}" for name in runs) + "     mean  spread"]
    for step in steps:
        rates = [points[step] for points in runs.values()]
        row = "  ".join(f"{rate:7.1%}" for rate in rates)
        lines.append(f"{step:4d}  {row}  {statistics.fmean(rates):7.1%}  {max(rates) - min(rates):6.1%}")
    first, last = steps[0], steps[-1]
    gains = [points[last] - points[first] for points in runs.values()]
    mean = statistics.fmean(gains)
    if len(gains) > 1:
        half = T95[len(gains) - 1] * statistics.stdev(gains) / len(gains) ** 0.5
        lines.append(
            f"gain step {first} -> {last}: mean {mean:+.1%}, per seed "
            + ", ".join(f"{gain:+.1%}" for gain in gains)
            + f", 95% interval [{mean - half:+.1%}, {mean + half:+.1%}]"
        )
    return lines


def plot(runs: dict[str, dict[int, float]], path: Path, title: str) -> None:
    import matplotlib  # lazy: only a run that plots needs it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # lazy: as above, once the backend is chosen

    figure, axes = plt.subplots(figsize=(6, 3.5))
    for name, points in runs.items():
        steps = sorted(points)
        axes.plot(steps, [points[s] for s in steps], marker="o", alpha=0.5, label=name)
    common = sorted(set.intersection(*(set(points) for points in runs.values())))
    mean = [statistics.fmean(points[s] for points in runs.values()) for s in common]
    axes.plot(common, mean, marker="s", color="black", linewidth=2, label="mean")
    axes.set_xlabel("training step (the policy evaluated: step-K)")
    axes.set_ylabel("held-out pass rate")
    axes.set_ylim(-0.02, 1.02)
    axes.set_title(title)
    axes.legend(loc="upper left")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("summaries", nargs="+", type=Path)
    parser.add_argument("--plot", type=Path)
    parser.add_argument("--title", default="SmolLM2-135M-Instruct, trajproxy train: held-out pass rate")
    args = parser.parse_args()
    runs = curves(args.summaries)
    print("\n".join(report(runs)))
    if args.plot:
        plot(runs, args.plot, args.title)


if __name__ == "__main__":
    main()
