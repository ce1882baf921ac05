"""The timeline ``benchmark.png``: per method, the training steps, the time training was blocked, and each
checkpoint's copy and flush phases (``tiered``: and the copy to the target, from the local commit until the commit
there, queue included).

Runs in the parent process after the last round (main thread). matplotlib is the optional ``bench`` extra
(``pip install 'lightning-datastates[bench]'``): imported only when a plot is drawn, with the ``Agg`` backend; without
it the plot is skipped with a message.
"""

from __future__ import annotations

from typing import Any


def plot_timeline(runs: dict[str, dict[str, Any]], path: str) -> bool:
    """Draw each method's steps, blocked waits and each checkpoint's copy and flush phases (and copy to the target);
    False without matplotlib (a message says how to install it)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("timeline skipped: matplotlib is not installed (pip install 'lightning-datastates[bench]')")
        return False
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.4 * len(runs) + 1), sharex=True, squeeze=False)
    for ax, (method, run) in zip(axes[:, 0], runs.items(), strict=True):
        for i, (a, b) in enumerate(run["steps"]):
            ax.broken_barh([(a, b - a)], (2, 0.8), color="0.55" if i % 2 else "0.75")
        for c in run["checkpoints"]:
            blocked = (c["start"], c["call_s"])
            ax.broken_barh([blocked], (2, 0.8), color="tab:red")
            if c.get("copy_end") is not None:
                ax.broken_barh([(c["start"], c["copy_end"] - c["start"])], (1, 0.8), color="tab:orange")
            if c.get("durable") is not None:
                ax.broken_barh([(c["flush_start"], c["durable"] - c["flush_start"])], (0, 0.8), color="tab:blue")
            if c.get("persistent_durable") is not None:  # tiered: local commit until the commit at the target
                ax.broken_barh([(c["durable"], c["persistent_durable"] - c["durable"])], (-1, 0.8), color="tab:green")
        for a, b in run["waits"]:
            ax.broken_barh([(a, b - a)], (2, 0.8), color="darkred")
        if any(c.get("persistent_durable") is not None for c in run["checkpoints"]):
            ax.set_yticks([-0.6, 0.4, 1.4, 2.4], ["to target", "flush", "copy", "steps"])
        else:
            ax.set_yticks([0.4, 1.4, 2.4], ["flush", "copy", "steps"])
        ax.set_ylabel(method, rotation=0, ha="right", va="center")
    axes[-1, 0].set_xlabel("seconds since fit started (red: training blocked by a checkpoint)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
