"""An optional PNG of a demo run (needs matplotlib, the ``plot`` extra)."""

from __future__ import annotations


def write_chart(result, path: str) -> bool:
    """Violations per step with the injected faults marked, and detection latency per class.
    Returns False when matplotlib is missing."""
    try:
        import matplotlib  # noqa: PLC0415

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: PLC0415
    except ImportError:
        return False
    from .faults import FAULT_CLASSES  # noqa: PLC0415

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), gridspec_kw={"height_ratios": [2, 1]})
    steps = range(len(result.violations_per_step))
    top.bar(steps, result.violations_per_step, width=1.0, color="#888", label="violations reported")
    colours = {name: f"C{index % 10}" for index, name in enumerate(FAULT_CLASSES)}  # matplotlib's ten
    seen = set()
    for fault in result.faults:
        label = fault.cls if fault.cls not in seen else None
        seen.add(fault.cls)
        style = "-" if fault.detected else ":"
        top.axvline(fault.step, color=colours[fault.cls], linestyle=style, alpha=0.8, label=label)
    top.set_xlabel("step")
    top.set_ylabel("violations")
    c = result.config
    top.set_title(f"kv-canary demo: {c.device}, hash mode {c.hash_mode.name}, {result.steps} steps, "
                  f"{len(result.false_positives)} false positives (dotted: fault not detected)")
    top.legend(fontsize=7, ncol=4)
    rows = result.per_class()
    names = list(rows)
    bottom.bar(names, [rows[n]["detection_rate"] for n in names], color=[colours[n] for n in names])
    bottom.set_ylim(0, 1.05)
    bottom.set_ylabel("detection rate")
    for i, name in enumerate(names):
        median = rows[name]["median_steps_to_detection"]
        bottom.text(i, 0.5, "-" if median is None else f"median {median:g} steps", ha="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
