"""Per model: torchcls' default path against the fastest peer, held to issue 31's goals — b16 throughput at
least B16_GAIN x the fastest peer's, b1 latency at most B1_RATIO x its, top-1 agreement with eager fp32 at
least MIN_AGREEMENT. A peer's own agreement is shown beside it: the goal is measured against the fastest
peer whatever its agreement, and again against the fastest one that agrees as the default must, when that
is another peer.
"""

from __future__ import annotations

PEERS = ("ort", "ort_int8", "ov_throughput", "ov_latency")
B16_GAIN = 1.2
B1_RATIO = 0.9
MIN_AGREEMENT = 0.99


def _fastest(rows: list[dict], key: str) -> dict | None:
    return min(rows, key=lambda r: r[key]) if rows else None


def _agrees(r: dict) -> bool:
    return r.get("top1_agreement", 0.0) >= MIN_AGREEMENT


def _against(default: dict, peers: list[dict]) -> dict:
    b16, b1 = _fastest(peers, "b16_ms"), _fastest(peers, "b1_ms")
    if b16 is None:
        return {}
    out = {"fastest_peer_b16": b16["config"], "fastest_peer_b16_agreement": b16.get("top1_agreement"),
           "b16_throughput_vs_peer": b16["b16_ms"] / default["b16_ms"],
           "fastest_peer_b1": b1["config"], "fastest_peer_b1_agreement": b1.get("top1_agreement"),
           "b1_latency_vs_peer": default["b1_ms"] / b1["b1_ms"]}
    out["b16_goal_met"] = out["b16_throughput_vs_peer"] >= B16_GAIN
    out["b1_goal_met"] = out["b1_latency_vs_peer"] <= B1_RATIO
    return out


def goal_summary(rows: list[dict]) -> list[dict]:
    """One record per model that has a `default` row: the default's path, the fastest peers, the ratios, and
    the fastest path overall (at MIN_AGREEMENT) at b16 and at b1, with its precision."""
    out = []
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        default = next((r for r in mine if r["config"] == "default"), None)
        if default is None:
            continue
        peers = [r for r in mine if r["config"] in PEERS]
        rec = {"model": model, "default_path": default.get("path"), "default_reason": default.get("reason"),
               "default_agreement": default.get("top1_agreement"),
               "goals": {"b16_throughput_vs_peer_min": B16_GAIN, "b1_latency_vs_peer_max": B1_RATIO,
                         "min_top1_agreement": MIN_AGREEMENT}}
        rec |= _against(default, peers)
        alt = _against(default, [r for r in peers if _agrees(r)])
        fastest = ("fastest_peer_b16", "fastest_peer_b1")
        if alt and [alt[k] for k in fastest] != [rec[k] for k in fastest]:
            rec["vs_agreeing_peers"] = alt  # the fastest peers disagree with eager fp32: also against those that agree
        rec["agreement_goal_met"] = _agrees(default)
        rec["all_goals_met"] = bool(peers) and rec["agreement_goal_met"] and rec["b16_goal_met"] and rec["b1_goal_met"]
        for key, batch in (("b16_ms", "b16"), ("b1_ms", "b1")):
            best = _fastest([r for r in mine if _agrees(r)], key)
            rec[f"fastest_{batch}"] = f"{best['config']} ({best.get('precision', '?')})" if best else None
        out.append(rec)
    return out


def goals_markdown(summary: list[dict]) -> str:
    def pct(v):
        return "–" if v is None else f"{v:.1%}"

    lines = [f"Default path against the fastest peer (goals: b16 throughput ≥ {B16_GAIN}× the peer's, b1 latency "
             f"≤ {B1_RATIO}× the peer's, top-1 agreement ≥ {MIN_AGREEMENT:.0%}):", "",
             "| model | default path | agree | b16 × fastest peer (its agreement) | b1 latency ÷ fastest peer "
             "(its agreement) | goals met | fastest b16 / b1 at ≥ 99% |", "|---|---|---|---|---|---|---|"]
    for s in summary:
        if "fastest_peer_b16" not in s:
            lines.append(f"| {s['model']} | {s['default_path']} | {pct(s['default_agreement'])} | no peer measured "
                         f"| | | {s['fastest_b16']} / {s['fastest_b1']} |")
            continue
        b16 = f"{s['b16_throughput_vs_peer']:.2f} vs {s['fastest_peer_b16']} ({pct(s['fastest_peer_b16_agreement'])})"
        b1 = f"{s['b1_latency_vs_peer']:.2f} vs {s['fastest_peer_b1']} ({pct(s['fastest_peer_b1_agreement'])})"
        if "vs_agreeing_peers" in s:
            a = s["vs_agreeing_peers"]
            b16 += f"; {a['b16_throughput_vs_peer']:.2f} vs {a['fastest_peer_b16']}"
            b1 += f"; {a['b1_latency_vs_peer']:.2f} vs {a['fastest_peer_b1']}"
        met = "yes" if s["all_goals_met"] else "no (" + ", ".join(
            k for k, ok in (("b16", s["b16_goal_met"]), ("b1", s["b1_goal_met"]),
                            ("agreement", s["agreement_goal_met"])) if not ok) + ")"
        lines.append(f"| {s['model']} | {s['default_path']} | {pct(s['default_agreement'])} | {b16} | {b1} | {met} "
                     f"| {s['fastest_b16']} / {s['fastest_b1']} |")
    lines += [""] + [f"- {s['model']}: default = {s['default_path']}: {s['default_reason']}" for s in summary]
    return "\n".join(lines)
