"""Turn a ``--benchmark-json`` file of this suite into a markdown table and a PNG chart.

    python benchmarks/report.py bench.json [--png chart.png] [--summary-png summary.png] [--markdown table.md]
    python benchmarks/report.py --index benchmarks/results [--markdown benchmarks/results/INDEX.md]

The table has one row per (case, op, mode): device time, host wall time per call in a back-to-back
loop (eager: Python, validation and launch; graph: replay launch), entries/s, effective GB/s, % of
the copy ceiling, speedup over the vectorised baseline and over the peer engine, and whether the row's
targets are met. The ceilings of the run come first and a list of every target (achieved vs wanted,
cross-case ones included) last. The chart (needs matplotlib) plots each row's effective bandwidth
against the run's copy ceiling; the summary chart, made for the README, plots the three kinds of
target: each case's step against the peer's, the large rows against the physical ceiling that
bounds them, and the decode-shaped ops against an empty kernel. ``--index`` lists every run of a
folder instead, a line each: commit, time, the card's ceilings and the targets met.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pathlib
import sys
from typing import Any, Optional

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

OPS_ORDER = ["step", "step_ops", "plan", "verify", "write", "scatter", "copy_records"]
# ALL-hash write against the same shape without hashing (target <= 1.2x)
ALL_HASH_TWINS = {"e2e_prefill_chunk_hash": "e2e_prefill_chunk_last", "prefill_hash_256b": "e2e_prefill_chunk_first",
                  "e2e_decode_steady_hash": "e2e_decode_steady"}


def load(path: str) -> tuple[Optional[dict], list[dict], dict]:
    data = _read(path)
    ceilings, rows, end_us = None, [], None
    for bench in data.get("benchmarks", []):
        info = dict(bench.get("extra_info") or {})
        if info.get("op") == "ceilings":
            ceilings = info
        elif info.get("op") == "ceilings_end":
            end_us = info["empty_kernel_us"]
        elif "case" in info and "time_us" in info:
            info["_name"] = bench.get("name")
            if info.get("naive_agrees") is False:
                # the benchmark failed its check: the baseline timed other work, so no ratio to it is met
                info["targets"] = [dict(t, met=False) if "naive" in t["name"] else t for t in info.get("targets") or []]
            rows.append(info)
    if ceilings is not None and end_us is not None:
        ceilings["empty_kernel_end_us"] = end_us
    return ceilings, rows, data


def _order(rows: list[dict]) -> list[dict]:
    cases: list[str] = []
    for r in rows:
        if r["case"] not in cases:
            cases.append(r["case"])
    try:
        from _shapes import CASES  # noqa: PLC0415
        known = [c.name for c in CASES]
        cases.sort(key=lambda c: known.index(c) if c in known else len(known))
    except Exception:  # the report also runs without the package importable
        pass
    key = lambda r: (cases.index(r["case"]), OPS_ORDER.index(r["op"]) if r["op"] in OPS_ORDER else 9,  # noqa: E731
                     r.get("mode") != "eager")
    return sorted(rows, key=key)


def _num(value: Any, fmt: str = "{:.2f}") -> str:
    if value is None:
        return "–"
    return fmt.format(value)


def _si(value: Optional[float]) -> str:
    if value is None:
        return "–"
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:.0f}"


def _naive_ratios(row: dict) -> str:
    """× naive: on device time, and (runs that timed it) on back-to-back wall time, ``device / wall``."""
    if row.get("naive_agrees") is False:
        return "baseline disagreed"
    device = _num(row.get("x_naive"), "{:.1f}")
    return device if row.get("x_naive_wall") is None else f"{device} / {row['x_naive_wall']:.1f}"


def _met(row: dict) -> str:
    targets = row.get("targets") or []
    if not targets:
        return ""
    marks = []
    for t in targets:
        mark = "✅" if t["met"] else "❌"
        marks.append(f"{mark} {t['name']} {_num(t['achieved'], '{:.3g}')} (want {t['target']})")
    return "<br>".join(marks)


def cross_targets(rows: list[dict]) -> list[dict]:
    """Targets spanning two rows: ALL-hash write against its no-hash twin, where the hashed row does
    not carry that check itself (the suite's rows do: counted there, once)."""
    writes = {r["case"]: r for r in rows if r["op"] == "write" and r.get("mode") == "eager"}
    out = []
    for hashed, plain in ALL_HASH_TWINS.items():
        carried = any(t["name"].startswith("ALL-hash write") for t in writes.get(hashed, {}).get("targets") or [])
        if hashed in writes and plain in writes and not carried:
            ratio = writes[hashed]["time_us"] / writes[plain]["time_us"]
            out.append(dict(name=f"write {hashed} / {plain}", achieved=ratio, target="<= 1.2", met=ratio <= 1.2))
    return out


def all_targets(rows: list[dict]) -> list[dict]:
    """Every target check of a run, each row's and the cross-case ones, named by their row."""
    every = [dict(t, row=f"{r['case']} {r['op']}{' (graph)' if r.get('mode') == 'graph' else ''}")
             for r in _order(rows) for t in (r.get("targets") or [])]
    return every + [dict(t, row="cross-case") for t in cross_targets(rows)]


def index(paths: list) -> str:
    """A table of runs, one line each: its commit and time, the card's ceilings measured in it, and
    its targets met. Files without the suite's ceilings (single-op probes) are left out."""
    lines = ["# Benchmark runs on H200 and H100 cards", "",
             "Made by `python benchmarks/report.py --index benchmarks/results` from the JSON of each run in",
             "this folder (older ones gzipped); each run's table is the `.md` of the same name. H200 cards",
             "differ (random reads 37 to 41 G/s), and an H100 reads less (30 G/s) against the same bars, set",
             "for an H200: compare a run with the ceilings measured in it. Each target",
             "check counts once; the prose written beside the runs up to 2026-12-02 counted each ALL-hash",
             "write check twice (on its row and again across rows): 168 checks for 165, and each of those",
             "three as two met or two missed.", "",
             "| run | card | commit | taken (UTC) | rows | copy GB/s | random reads G/s | random gather G/s | "
             "empty kernel µs | targets met |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for path in sorted(paths, key=lambda p: (json_time(p), str(p))):
        ceilings, rows, data = load(str(path))
        if ceilings is None or not rows:
            continue
        every = all_targets(rows)
        reads = ceilings.get("read32_entries_per_s")
        name = pathlib.Path(path).name
        card = str(ceilings.get("device_name") or "–").replace("NVIDIA ", "")
        lines.append(f"| `{name}` | {card} | {str((data.get('commit_info') or {}).get('id', ''))[:10]} | "
                     f"{str(data.get('datetime', ''))[:16].replace('T', ' ')} | {len(rows)} | "
                     f"{ceilings['copy_gbps']:.0f} | {'–' if reads is None else f'{reads / 1e9:.2f}'} | "
                     f"{ceilings['gather32_entries_per_s'] / 1e9:.2f} | {ceilings['empty_kernel_us']:.2f} | "
                     f"{sum(1 for t in every if t['met'])} of {len(every)} |")
    return "\n".join(lines) + "\n"


def json_time(path) -> str:
    """When a run was taken, from its JSON (for ordering the index)."""
    return str(_read(path).get("datetime", ""))


def _read(path) -> dict:
    raw = pathlib.Path(path).read_bytes()
    return json.loads(gzip.decompress(raw) if str(path).endswith(".gz") else raw)  # older runs are kept gzipped


def markdown(ceilings: Optional[dict], rows: list[dict], data: dict) -> str:
    lines = []
    first = rows[0] if rows else {}
    device = (ceilings or {}).get("device_name") or first.get("device", "?")
    lines.append(f"**Device:** {device} · scale {first.get('scale', '?')} · "
                 f"{data.get('datetime', '')} · commit {str((data.get('commit_info') or {}).get('id', ''))[:10]}")
    lines.append("")
    if ceilings:
        graph = ceilings.get("empty_graph_us")
        lines.append(
            f"**Ceilings:** copy {ceilings['copy_gbps']:.0f} GB/s (read+write) · random 32-B gather "
            f"{ceilings['gather32_entries_per_s'] / 1e9:.2f} G entries/s ({ceilings['gather32_gbps']:.0f} GB/s) · "
            + (f"random 32-B read, nothing written {ceilings['read32_entries_per_s'] / 1e9:.2f} G entries/s · "
               if ceilings.get("read32_entries_per_s") else "")
            + (f"plan-shaped stream {ceilings['plan_stream_entries_per_s'] / 1e9:.2f} G entries/s "
               f"({ceilings['plan_stream_us']:.1f} µs for {_si(ceilings['plan_stream_entries'])} entries, "
               f"{ceilings['plan_stream_gbps']:.0f} GB/s) · " if ceilings.get("plan_stream_us") else "")
            + f"empty kernel {ceilings['empty_kernel_us']:.2f} µs device"
            + (f" ({ceilings['empty_kernel_end_us']:.2f} µs at the end of the run)"
               if ceilings.get("empty_kernel_end_us") is not None else "")
            + (f", {graph:.2f} µs as graph replay" if graph else "")
            + f", {ceilings['empty_launch_host_us']:.2f} µs host per launch")
        lines.append("")
    header = ["case", "shape", "op", "time µs", "host µs", "entries/s", "GB/s", "% copy", "× naive", "× peer",
              "targets"]
    lines.append("| " + " | ".join(header) + " |")
    lines.append("|" + "|".join(["---"] * len(header)) + "|")
    for r in _order(rows):
        op = r["op"] + (" (graph)" if r.get("mode") == "graph" else "")
        lines.append("| " + " | ".join([
            r["case"], r.get("shape", ""), op, _num(r["time_us"]),
            _num(r.get("graph_wall_us") if r.get("mode") == "graph" else r.get("wall_us_per_call"), "{:.1f}"), _si(r.get("entries_per_s")) if r.get("entries") else "–",
            _num(r.get("gbps"), "{:.1f}"), _num(r.get("pct_copy_ceiling"), "{:.1f}"),
            _naive_ratios(r), _num(r.get("x_peer"), "{:.2f}"), _met(r),
        ]) + " |")
    readers = [r for r in _order(rows) if r.get("pct_random_read") is not None and r.get("mode") != "graph"]
    if readers and ceilings:
        lines.append("")
        lines.append("**Random reads.** The random 32-byte sectors that a verify or step row's verify entries "
                     "read (each its slot, and the sectors each source hashed spans) a second, against the bare kernels:")
        lines.append("")
        lines.append("| case | op | sectors an entry | G sectors/s | % random read | % random gather |")
        lines.append("|---|---|---|---|---|---|")
        for r in readers:
            lines.append(f"| {r['case']} | {r['op']} | {r['random_sectors_per_entry']} | "
                         f"{r['random_sectors_per_s'] / 1e9:.2f} | {r['pct_random_read']:.0f} | "
                         f"{100.0 * r['random_sectors_per_s'] / ceilings['gather32_entries_per_s']:.0f} |")
    every = all_targets(rows)
    if every:
        met = sum(1 for t in every if t["met"])
        lines.append("")
        lines.append(f"**Targets:** {met} of {len(every)} met" +
                     ("" if first.get("scale", 1) >= 1 and first.get("device") == "cuda"
                      else " (not binding: a scaled-down or CPU run)"))
        lines.append("")
        lines.append("| row | target | achieved | wanted | met |")
        lines.append("|---|---|---|---|---|")
        for t in every:
            lines.append(f"| {t['row']} | {t['name']} | {_num(t['achieved'], '{:.3g}')} | {t['target']} | "
                         f"{'yes' if t['met'] else '**no**'} |")
    return "\n".join(lines) + "\n"


def _pyplot():
    try:
        import matplotlib  # noqa: PLC0415
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return None
    return plt


def chart(ceilings: Optional[dict], rows: list[dict], path: str) -> bool:
    plt = _pyplot()
    if plt is None:
        print(f"(matplotlib is not installed: no chart written to {path})", file=sys.stderr)
        return False
    rows = [r for r in _order(rows) if r.get("gbps") is not None]
    labels = [f"{r['case']} · {r['op']}{' (graph)' if r.get('mode') == 'graph' else ''}" for r in rows]
    colors = {"step": "#4c72b0", "step_ops": "#937860", "plan": "#dd8452", "verify": "#55a868", "write": "#c44e52", "scatter": "#8172b3"}
    fig, ax = plt.subplots(figsize=(11, max(4.0, 0.22 * len(rows) + 1.5)))
    y = list(range(len(rows)))
    values = [max(r["gbps"], 1e-3) for r in rows]
    ax.barh(y, values, color=[colors.get(r["op"], "#999999") for r in rows],
            hatch=None, alpha=0.9)
    for yi, r in zip(y, rows):
        if r.get("mode") == "graph":
            ax.barh([yi], [max(r["gbps"], 1e-3)], color="none", edgecolor="black", hatch="//", linewidth=0)
    if ceilings:
        ax.axvline(ceilings["copy_gbps"], color="black", linestyle="--", linewidth=1.2,
                   label=f"copy ceiling {ceilings['copy_gbps']:.0f} GB/s")
        ax.axvline(ceilings["gather32_gbps"], color="grey", linestyle=":", linewidth=1.2,
                   label=f"random 32-B gather {ceilings['gather32_gbps']:.0f} GB/s")
    ax.set_xscale("log")
    ax.set_yticks(y)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("effective GB/s (minimum bytes moved / device time), log scale")
    device = (ceilings or {}).get("device_name") or (rows[0].get("device") if rows else "")
    ax.set_title(f"kvcanary_cupy throughput against the copy ceiling — {device}")
    from matplotlib.patches import Patch  # noqa: PLC0415
    handles, _ = ax.get_legend_handles_labels()
    handles += [Patch(color=c, label=op) for op, c in colors.items()]
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


# Rows with at least this many entries are bound by memory, not latency: the summary reads them
# against a bandwidth ceiling.
LARGE_ENTRIES = 500_000


def _target_met(row: dict, word: str) -> Optional[bool]:
    found = [t["met"] for t in row.get("targets") or [] if word in t["name"]]
    return all(found) if found else None


def summary_panels(ceilings: Optional[dict], rows: list[dict]) -> list[dict]:
    """The summary chart's three panels, as data: each a title, a bar per row (label, value, the
    target met or not) and the target line."""
    eager = [r for r in _order(rows) if r.get("mode") != "graph"]
    graph = {r["case"]: r for r in rows if r["op"] == "step" and r.get("mode") == "graph"}
    steps = []
    for r in eager:
        if r["op"] != "step" or r.get("x_peer") is None:
            continue
        best = max(r["x_peer"], (graph.get(r["case"]) or {}).get("x_peer") or 0.0)
        steps.append(dict(label=r["case"], value=best, met=_target_met(r, "peer")))
    large = []
    for r in eager:
        if (r.get("entries") or 0) < LARGE_ENTRIES:
            continue
        if r["op"] == "plan" and r.get("pct_copy_ceiling") is not None:
            large.append(dict(label=f"{r['case']} · plan (of copy)", value=r["pct_copy_ceiling"], met=None))
        elif r["op"] in ("step", "verify") and r.get("pct_random_read") is not None:
            large.append(dict(label=f"{r['case']} · {r['op']} (of random reads)", value=r["pct_random_read"],
                              met=None))
    decode = [dict(label=f"{r['case']} · {r['op']}", value=r["x_empty_kernel"], met=_target_met(r, "empty"))
              for r in eager if _target_met(r, "empty") is not None and r.get("x_empty_kernel") is not None]
    empty_us = (ceilings or {}).get("empty_kernel_us")
    return [
        dict(title="one forward's step: × faster than the peer's\n(best of eager and graph replay)",
             bars=steps, line=2.0, line_label="target 2×", xlabel="× faster (log scale)", log=True),
        dict(title="large rows: % of the ceiling that bounds them\n(plans: copy; verify: random 32-B reads)",
             bars=large, line=100.0, line_label="ceiling", xlabel="% of the same-run ceiling", log=False),
        dict(title="decode-shaped ops: device time / empty kernel"
                   + (f"\n(empty kernel {empty_us:.2f} µs)" if empty_us else ""),
             bars=decode, line=2.0, line_label="target ≤ 2×", xlabel="× an empty kernel", log=False),
    ]


def summary_chart(ceilings: Optional[dict], rows: list[dict], path: str) -> bool:
    plt = _pyplot()
    if plt is None:
        print(f"(matplotlib is not installed: no chart written to {path})", file=sys.stderr)
        return False
    panels = summary_panels(ceilings, rows)
    heights = [max(3, len(p["bars"])) for p in panels]
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 0.24 * sum(heights) + 3.2),
                             gridspec_kw=dict(height_ratios=heights))
    colour = {True: "#55a868", False: "#c44e52", None: "#4c72b0"}
    for ax, panel in zip(axes, panels):
        bars = panel["bars"]
        y = list(range(len(bars)))
        ax.barh(y, [b["value"] for b in bars], color=[colour[b["met"]] for b in bars])
        for yi, b in zip(y, bars):
            ax.text(b["value"], yi, f" {b['value']:.0f}" if panel["line"] >= 10 else f" {b['value']:.2f}",
                    va="center", fontsize=7)
        ax.axvline(panel["line"], color="black", linestyle="--", linewidth=1, label=panel["line_label"])
        if panel["log"]:
            from matplotlib.ticker import NullFormatter  # noqa: PLC0415
            ax.set_xscale("log")
            top = max([b["value"] for b in bars] + [panel["line"]])
            ax.set_xticks([t for t in (1, 2, 3, 5, 10, 20, 50, 100, 200) if t <= 1.5 * top])
            ax.set_xticklabels([f"{t}×" for t in ax.get_xticks()])
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_yticks(y)
        ax.set_yticklabels([b["label"] for b in bars], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(panel["title"], fontsize=9)
        ax.set_xlabel(panel["xlabel"], fontsize=8)
        ax.legend(fontsize=7, loc="best")
        ax.grid(axis="x", alpha=0.3)
    device = (ceilings or {}).get("device_name") or (rows[0].get("device") if rows else "")
    fig.suptitle(f"kvcanary_cupy on {device}: green target met, red missed, blue no target", fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.98))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="?",
                        help="a pytest-benchmark --benchmark-json file of this suite (or it gzipped, .json.gz)")
    parser.add_argument("--index", metavar="DIR",
                        help="instead: print the table of every run's JSON in DIR (--markdown writes it too)")
    parser.add_argument("--png", help="write the throughput chart here (needs matplotlib)")
    parser.add_argument("--summary-png", help="write the README's summary chart here (needs matplotlib)")
    parser.add_argument("--markdown", help="also write the table to this file")
    args = parser.parse_args(argv)
    if args.index:
        if not pathlib.Path(args.index).is_dir():  # else a mistyped folder would write an index of no runs
            parser.error(f"--index {args.index}: no such folder")
        text = index(sorted(pathlib.Path(args.index).glob("*.json*")))
        print(text, end="")
        if args.markdown:
            pathlib.Path(args.markdown).write_text(text)
        return 0
    if not args.json:
        parser.error("a JSON file, or --index DIR")
    try:
        ceilings, rows, data = load(args.json)
    except (OSError, ValueError) as exc:  # a missing file, or one that is not (gzipped) JSON
        parser.error(f"{args.json}: {exc}")
    if not rows:
        print(f"no benchmark rows of this suite in {args.json}", file=sys.stderr)
        return 1
    text = markdown(ceilings, rows, data)
    print(text)
    if args.markdown:
        pathlib.Path(args.markdown).write_text(text)
    if args.png:
        chart(ceilings, rows, args.png)
    if args.summary_png:
        summary_chart(ceilings, rows, args.summary_png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
