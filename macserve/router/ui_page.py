"""The web page's HTML, rendered here (one renderer: the first page and every update the page
receives over SSE are the same fragments). Every value is escaped; no profile secret is ever
passed in (ui_ops.overview says only whether a profile has a key).
"""

from __future__ import annotations

from html import escape
from importlib import resources

from .model import size

STATIC = resources.files(__package__) / "static"


def _e(v) -> str:
    return escape("" if v is None else str(v), quote=True)


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    s = int(s)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


COLORS = ("#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1")


def color(i: int) -> str:
    return COLORS[i % len(COLORS)]


def budget_bar(b: dict, names: list[str]) -> str:
    total = b["bytes"] or 1
    parts = []
    for u in b["used"]:
        pct = 100 * u["bytes"] / total
        i = names.index(u["name"]) if u["name"] in names else 0
        parts.append(
            f'<span class="seg" style="width:{pct:.2f}%;background:{color(i)}" '
            f'title="{_e(u["name"])}: {_e(size(u["bytes"]))}"></span>'
        )
    legend = " ".join(
        f'<span class="key"><i style="background:{color(names.index(u["name"]) if u["name"] in names else 0)}"></i>'
        f"{_e(u['name'])} {_e(size(u['bytes']))}</span>"
        for u in b["used"]
    )
    return (
        f'<div class="bar" role="img" aria-label="memory budget">{"".join(parts)}</div>'
        f'<div class="legend">{legend} <span class="key free">free {_e(size(b["free"]))} of '
        f"{_e(size(b['bytes']))} ({_e(b['source'])}); free on this machine now "
        f'<span class="machine-free">{_e(size(b.get("machine_free")))}</span></span></div>'
    )


def _state(r: dict) -> str:
    why = f'<div class="why">{_e(r["why"])}</div>' if r.get("why") else ""
    return f'<span class="state s-{_e(r["state"])}">{_e(r["state"])}</span>{why}'


def _row(r: dict, i: int) -> str:
    n = _e(r["name"])
    if r["state"] == "invalid":
        return f'<tr data-name="{n}"><td class="name">{n}</td><td colspan="9">{_state(r)}</td></tr>'
    fp = "-"
    sh = r["share"]
    if r["share_bytes"] is not None:
        parts = (
            f"MEMORY={size(sh['memory_bytes'])}"
            if sh["memory_bytes"] is not None
            else f"weights {size(sh['weights_bytes'])} + KV {size(sh['kv_bytes'])} x "
            f"{sh['parallel']} + prompt cache {size(sh['prompt_cache_bytes'])} + baseline "
            f"{size(sh['baseline_bytes'])} ({sh['baseline_source']}) + reserve "
            f"{size(sh['reserve_bytes'])}"
        )
        fp = f'{_e(size(r["share_bytes"]))}<div class="sub">{_e(parts)}</div>'
        if sh.get("kv_note"):  # what KV=auto will do in this share
            fp += f'<div class="sub kv-auto">{_e(sh["kv_note"])}</div>'
    elif r.get("share_note"):
        fp = f'unknown<div class="why">{_e(r["share_note"])}</div>'
    res = r["resident"]
    held = "-"
    if res["now_bytes"] is not None:
        peak = size(res["peak_bytes"]) if res["peak_bytes"] is not None else "unknown"
        held = (
            f'{_e(size(res["now_bytes"]))}<div class="sub">peak {_e(peak)}</div>'
            f'<div class="sub" title="{_e(res["source"])}">{_e(res["note"] or res["source"])}</div>'
        )
    kv_opts = "".join(
        f'<option value="{_e(k)}"{" selected" if r["kv_set"] and k == r["kv"] else ""}>{_e(k)}</option>'
        for k in r["kv_choices"]
    )
    if not r["kv_set"]:  # the provider's default: shown as what inspect counts
        kv_opts = f'<option value="" selected>{_e(r["kv"] or "default")}</option>' + kv_opts
    kv_initial = r["kv"] if r["kv_set"] else ""
    ctx_initial = r["ctx"] if r["ctx_set"] else ""
    running = r["state"] in ("running", "starting", "crash-loop")
    btns = (
        f'<button data-act="stop" data-name="{n}">stop</button>'
        f'<button data-act="restart" data-name="{n}">restart</button>'
        if running
        else f'<button data-act="start" data-name="{n}">start</button>'
    )
    if r["ttl_s"] is None:
        ttl = "never"
    elif r["ttl_left_s"] is None:  # not running: its TTL, counted from its next request
        ttl = _dur(r["ttl_s"])
    else:
        ttl = _dur(r["ttl_left_s"]) + " left"
    return (
        f'<tr data-name="{n}" data-state="{_e(r["state"])}">'
        f'<td class="name"><i style="background:{color(i)}"></i>{n}'
        f'<div class="sub">{_e(r["provider"])}</div></td>'
        f'<td class="model" title="{_e(r["model"])}">{_e(r["model"])}</td>'
        f"<td>{_state(r)}</td><td>{_e(r['port'])}</td>"
        f'<td><form class="set" data-name="{n}">'
        f'<input name="CTX" inputmode="numeric" size="7" value="{_e(r["ctx"])}" '
        f'data-initial="{_e(ctx_initial or r["ctx"])}" aria-label="context">'
        f'<select name="KV" data-initial="{_e(kv_initial)}" aria-label="cache type">{kv_opts}</select>'
        f'<button type="submit">set</button></form></td>'
        f'<td class="share">{fp}</td><td class="resident">{held}</td>'
        f"<td>{_e(_dur(r['idle_s']))}</td><td>{_e(ttl)}</td>"
        f'<td class="acts">{btns}</td></tr>'
    )


def overview_html(ov: dict) -> str:
    names = [r["name"] for r in ov["rows"]]
    rows = "".join(_row(r, i) for i, r in enumerate(ov["rows"]))
    return (
        f'<section id="budget"><h2>Memory budget</h2>{budget_bar(ov["budget"], names)}</section>'
        '<div class="scroll"><table id="profiles"><thead><tr><th>profile</th><th>model</th>'
        "<th>state</th><th>port</th><th>context · cache</th><th>share</th><th>resident</th>"
        "<th>idle</th><th>TTL</th><th></th></tr></thead>"
        f"<tbody>{rows}</tbody></table></div>"
    )


def page(ov: dict, csrf: str, keyed: bool) -> str:
    names = [r["name"] for r in ov["rows"]]  # in the table's order: a model's colour
    options = "".join(
        f'<option value="{_e(r["name"])}">{_e(r["name"])}</option>'
        for r in ov["rows"]
        if r["state"] != "invalid"
    )
    body = f"""
<header><h1>macserve</h1><span id="live" class="dim">connecting…</span></header>
<main>
<section id="overview">{overview_html(ov)}</section>
<p id="outcome" role="status" aria-live="polite"></p>
<section id="charts"><h2>Live</h2>
<div class="chart"><h3>tokens/s</h3><svg id="tps" viewBox="0 0 600 160"></svg></div>
<div class="chart"><h3>time to first token (s)</h3><svg id="ttft" viewBox="0 0 600 160"></svg></div>
<div id="chart-legend" class="legend"></div>
</section>
<section id="chat"><h2>Chat</h2>
<form id="chat-form"><select name="model" aria-label="profile">{options}</select>
<textarea name="prompt" rows="2" placeholder="Say something"></textarea>
<button type="submit">send</button><button type="button" id="chat-stop" disabled>stop</button></form>
<pre id="chat-out"></pre><p id="chat-stats" class="dim"></p>
</section>
<section id="logs"><h2>Logs</h2><div id="log-list"></div></section>
</main>"""
    return _doc(body, csrf, names, keyed)


def prompt(message: str = "") -> str:
    """All a visitor without the key sees."""
    msg = f'<p class="err">{_e(message)}</p>' if message else ""
    body = f"""
<header><h1>macserve</h1></header>
<main><form id="login" method="post" action="/ui/login">
<h2>This router wants its API key</h2>{msg}
<input type="password" name="key" autocomplete="current-password" aria-label="API key" autofocus>
<button type="submit">open</button>
<p class="dim">Kept in this browser as an HttpOnly cookie for this page only.</p>
</form></main>"""
    return _doc(body, "", [], False)


def _doc(body: str, csrf: str, names: list[str], keyed: bool) -> str:
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta name="csrf" content="{_e(csrf)}">
<meta name="colors" content="{_e(",".join(color(i) for i in range(len(names))))}">
<meta name="names" content="{_e(",".join(names))}">
<title>macserve router</title>
<link rel="stylesheet" href="/ui/static/ui.css">
<script src="/ui/static/ui.js" defer></script></head>
<body{' class="keyed"' if keyed else ""}>{body}</body></html>"""
