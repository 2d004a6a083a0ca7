"""The viewer's HTML page shell and the escaping every page goes through.

Everything a page shows from a run (model output, env text, metric names, file names) passes :func:`e` or
:func:`e_text`: HTML-escaped, with Unicode bidi controls turned into visible markers, under a Content-Security-Policy
that allows no script. Also the tolerant readers of a run's JSONL files.
"""

from __future__ import annotations

import html
import json
import math
import re
from pathlib import Path
from typing import Any, Iterator

from ragen.files import write_text_atomic

CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:1.2em auto;max-width:1200px;
     padding:0 1em;color:#222;background:#fff}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.4em}h3{font-size:1em;margin:.6em 0 .3em}
a{color:#0645ad}
nav{margin-bottom:1em;font-size:.9em}nav a{margin-right:1em}
table.data{border-collapse:collapse;font-size:.85em}
table.data th,table.data td{border:1px solid #ccc;padding:3px 7px;text-align:right}
table.data th{background:#f3f3f3;position:sticky;top:0}
table.data td.l,table.data th.l{text-align:left}
tr.ok td.succ{color:#1a7f37;font-weight:600}tr.fail td.succ{color:#b42318}
pre{white-space:pre-wrap;word-break:break-word;background:#f7f7f7;border:1px solid #e3e3e3;
    padding:.5em;margin:.3em 0;font-size:.85em}
pre.think{background:#f5f3ff;border-color:#ddd6fe}pre.answer{background:#ecfdf3;border-color:#abefc6}
.meta{font-size:.9em;color:#444}.meta b{color:#222}
.turn{border:1px solid #ddd;border-radius:6px;padding:.6em .8em;margin:.8em 0}
.turn-head{font-weight:600;margin-bottom:.3em}
.bad{color:#b42318;font-weight:600}.good{color:#1a7f37;font-weight:600}
.frame{display:flex;gap:1.2em;align-items:flex-start;flex-wrap:wrap}
table.grid{border-collapse:collapse;margin:.3em 0}
table.grid td{width:26px;height:26px;padding:0;text-align:center;font:bold 13px monospace;
              border:1px solid rgba(0,0,0,.15)}
.legend{font-size:.8em;line-height:1.8}
.legend span.sw{display:inline-block;width:14px;height:14px;vertical-align:middle;
                border:1px solid rgba(0,0,0,.25);margin:0 4px 0 10px}
.sk-wall{background:#4b4b4b;color:#bbb}.sk-floor{background:#ece6d8;color:#b9b1a0}
.sk-target{background:#ece6d8;color:#d4380d;box-shadow:inset 0 0 0 3px #fa8c16}
.sk-box{background:#a0632f;color:#fff}.sk-boxok{background:#2f9e44;color:#fff}
.sk-player{background:#1c7ed6;color:#fff}.sk-playerok{background:#1c7ed6;color:#fff;box-shadow:inset 0 0 0 3px #fa8c16}
.fl-player{background:#e8590c;color:#fff}.fl-ice{background:#d0ebff;color:#74a9cf}
.fl-hole{background:#1b1f3b;color:#8f96c9}.fl-goal{background:#fcc419;color:#5c3c00}
.fl-dead{background:#7a0c0c;color:#fff}.fl-won{background:#2f9e44;color:#fff}
.unk{background:#fff;color:#c00}
img.render{image-rendering:pixelated;border:1px solid #ccc;margin:.3em 0;display:block}
p.note{color:#8a5a00;font-style:italic}
.tokens{font:12px/1.7 ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;white-space:pre-wrap;
        word-break:break-all;border:1px solid #e3e3e3;padding:.5em}
.tokens span{border-radius:2px;box-shadow:inset -1px 0 rgba(0,0,0,.13)}
.tokens span.m{color:#9a9a9a;background:#f1f1f1}
.tokens span.z{background:#fff;outline:1px dotted #c8c8c8}
div.allm{min-width:24em;max-width:48em;white-space:normal}div.allm p{margin:.2em 0}
""" + "".join(
    # Advantage buckets: p1..p8 green (positive), n1..n8 red (negative), stronger = larger |A|.
    f".tokens span.p{i},.legend span.p{i}{{background:rgba(34,160,70,{0.12 + 0.11 * (i - 1):.2f})}}"
    f".tokens span.n{i},.legend span.n{i}{{background:rgba(220,50,47,{0.12 + 0.11 * (i - 1):.2f})}}"
    for i in range(1, 9)
) + ".legend span.m{background:#f1f1f1}.legend span.z{background:#fff;outline:1px dotted #c8c8c8}\n" + (
    # Last, so it wins over `.tokens span` when a token holds one.
    "span.bidi{color:#b42318;background:#fff1f0;border:1px solid #ffa39e;border-radius:2px;box-shadow:none;"
    "font:bold .8em ui-monospace,monospace;padding:0 1px}\n"
)

# Unicode bidirectional controls (the "Trojan Source" set): ALM, LRM, RLM, the embeddings/overrides LRE..RLO and the
# isolates LRI..PDI. Each only steers how the text around it is displayed; none is a letter, so showing it as a
# marker loses nothing, while Arabic or Hebrew letters (which carry their own direction) are left as they are.
_BIDI_RE = re.compile("[\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _write_page(path: Path, text: str) -> None:
    """Write a page atomically (a browser or ``--serve`` reading it during a re-run gets the old page or the new one,
    never half of one); what UTF-8 cannot hold (lone surrogates: a non-UTF-8 file name, broken env text) becomes ``?``."""
    write_text_atomic(path, text.encode("utf-8", "replace").decode("utf-8"))


def _bidi_marker(char: str) -> str:
    """A bidi control as inert, escaped text: ``&lt;U+202E&gt;``."""
    return f"&lt;U+{ord(char):04X}&gt;"


def e(value: Any) -> str:
    """HTML-escape anything (attribute-safe); bidi controls become a plain ``<U+202E>`` marker.

    Plain text and no markup, so the result is safe inside an attribute or ``<title>`` too; :func:`e_text` adds the
    highlight where the text is element content.
    """
    escaped = html.escape("" if value is None else str(value), quote=True)
    return _BIDI_RE.sub(lambda m: _bidi_marker(m.group()), escaped)


def e_text(value: Any) -> str:
    """:func:`e` for element content: each bidi control marker is also highlighted, so it cannot pass for text.

    The highlight is what tells a real control from a model that merely wrote the characters ``<U+202E>``.
    """
    escaped = html.escape("" if value is None else str(value), quote=True)
    return _BIDI_RE.sub(lambda m: f"<span class='bidi' title='bidi control'>{_bidi_marker(m.group())}</span>", escaped)


# ----------------------------------------------------------------------------- reading


def read_jsonl(path: Path) -> Iterator[dict]:
    """The JSON objects of a JSONL file; blank, malformed and non-object lines are skipped."""
    try:
        handle = open(path, encoding="utf-8-sig", errors="replace")
    except OSError:
        return
    with handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                yield obj


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and math.isfinite(value) and value == int(value):
        return int(value)
    if isinstance(value, str):
        try:  # "--3", "²" or 5000 digits pass a str test but are no step
            return int(value.strip())
        except ValueError:
            return None
    return None


def json_number(value: Any) -> float | None:
    """A JSON number (or bool) as a float, NaN and ±inf kept, an int past float range as ±inf; else None."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, int):
        try:
            return float(value)
        except OverflowError:  # more digits than a float holds
            return math.inf if value > 0 else -math.inf
    if isinstance(value, float):
        return value
    return None


def _as_float(value: Any) -> float | None:
    """:func:`json_number`, and a number written as a string."""
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return None
    return json_number(value)


# ----------------------------------------------------------------------------- formatting


def fmt(value: Any) -> str:
    """A metric or reward value as escaped display text."""
    if value is None or value == "":
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return e(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            return e(value)
        return e(f"{value:.4g}")
    return e(value)


# ----------------------------------------------------------------------------- pages


# How every page starts (up to the CSP, which may change between versions): what marks a file as one of ours.
_PAGE_HEAD = "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'><meta http-equiv='Content-Security-Policy'"


def _page(title: str, body: str, nav: str = "") -> str:
    return (
        f"{_PAGE_HEAD} content=\"{CSP}\">"
        "<meta name='referrer' content='no-referrer'>"
        "<meta name='viewport' content='width=device-width,initial-scale=1'>"
        f"<title>{e(title)}</title><style>{CSS}</style></head><body>"
        f"<nav>{nav}</nav>{body}</body></html>\n"
    )
