"""`reports/conformance/index.html`: one self-contained page (inline CSS, no scripts, no network).

Everything shown comes from results.json and is escaped by jinja2's autoescape.
"""

from __future__ import annotations

from typing import Any

from jinja2 import Environment

TEMPLATE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>DFlash conformance: {{ r.implementation }}</title>
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#f3f3f3}.pass{background:#e3f6e3}.fail{background:#fbe0e0}.n-a{background:#eee;color:#666}
.references-differ{background:#fff3cd}.plug-mismatch{background:#e0e8fb}.missing{background:#fbe0e0}code,pre{font:12px monospace}
pre{white-space:pre-wrap;margin:0}.caught{background:#e3f6e3}.missed{background:#fbe0e0}
</style></head><body>
<h1>DFlash conformance: {{ r.implementation }}</h1>
<p>{{ s["pass"] }} pass, {{ s["fail"] }} fail, {{ s["references differ"] }} where the references differ,
{{ s["n/a"] }} not applicable{% if s["plug-mismatch"] %}, {{ s["plug-mismatch"] }} plug mismatch(es): calls the
plug (interface {{ r.interface.plug }}) cannot take in interface {{ r.interface.suite }}, not divergences of the codebase
it wraps{% endif %}.
{% if s["fail"] == 0 %}<strong>No divergence from the references.</strong>{% endif %}
Planted bugs caught: {{ s.planted_caught }}/{{ s.planted_total }}.</p>

<h2>PITFALLS entries</h2>
<table><tr><th>#</th><th>component</th><th>status</th></tr>
{% for n, p in r.pitfalls.items() %}<tr class="{{ p.status|css }}"><td>{{ n }}</td><td>{{ p.component }}</td>
<td>{{ p.status }}</td></tr>{% endfor %}</table>

<h2>Comparisons</h2>
<table><tr><th>#</th><th>component</th><th>implementations</th><th>test</th><th>status</th><th>comparisons</th>
<th>detail</th></tr>
{% for c in r.components %}<tr class="{{ c.status|css }}"><td>{{ c.pitfall }}</td><td>{{ c.component }}</td>
<td>{{ c.implementations|join(" vs ") }}</td><td><code>{{ c.test }}</code></td><td>{{ c.status }}</td>
<td>{{ c.comparisons }}</td><td>{{ c.reason }}{% if c.diff %}{{ c.diff.message }}{% endif %}</td></tr>{% endfor %}
</table>

<h2>Where the references differ</h2>
{% set changes = r.references_differ_changes %}
{% if r.references_differ %}<table><tr><th>#</th><th>component</th><th>references</th><th>test</th><th>difference</th></tr>
{% for c in r.references_differ %}<tr class="references-differ"><td>{{ c.pitfall }}</td><td>{{ c.component }}</td>
<td>{{ c.implementations|join(" vs ") }}</td><td><code>{{ c.test }}</code></td><td>{{ c.diff.message if c.diff }}</td></tr>
{% endfor %}</table>{% else %}<p>No comparison of two references differed in this run.</p>{% endif %}
{% if changes.gained or changes.lost %}<p class="fail"><strong>Not the known set</strong> (references_differ.toml):
{% for c in changes.gained %}new: <code>{{ c.test }}</code>; {% endfor %}
{% for c in changes.lost %}no longer differ: <code>{{ c.test }}</code>; {% endfor %}</p>
{% else %}<p>Exactly the known disagreements (references_differ.toml) among the comparisons run.</p>{% endif %}

{% set diffs = r.components|selectattr("diff")|list %}
{% if diffs %}<h2>Diff entries</h2>{% endif %}
{% for c in diffs %}{% set d = c.diff %}
<h3 class="{{ c.status|css }}">{{ d.component }} (#{{ d.pitfall }}): {{ d.implementations|join(" vs ") }} — {{ c.status }}</h3>
<table>
<tr><th>test</th><td><code>{{ d.test }}</code></td></tr>
<tr><th>message</th><td>{{ d.message }}</td></tr>
<tr><th>shapes</th><td>{{ d.shapes[0] }} / {{ d.shapes[1] }}</td></tr>
<tr><th>dtypes</th><td>{{ d.dtypes[0] }} / {{ d.dtypes[1] }}</td></tr>
<tr><th>max abs / max rel</th><td>{{ d.max_abs }} / {{ d.max_rel }}</td></tr>
<tr><th>first differing index</th><td>{{ d.first_index }}: {{ d.values[0] }} vs {{ d.values[1] }}</td></tr>
{% if d.window %}<tr><th>window (flat from {{ d.window.flat_start }})</th><td><pre>{{ d.implementations[0] }}: {{ d.window.a }}
{{ d.implementations[1] }}: {{ d.window.b }}</pre></td></tr>{% endif %}
<tr><th>example (minimized)</th><td><pre>{{ d.example }}</pre></td></tr>
</table>{% endfor %}

<h2>Planted-bug detection</h2>
{% if r.planted %}<table><tr><th>bug</th><th>component</th><th>#</th><th>caught</th><th>diff entry points at</th></tr>
{% for p in r.planted %}<tr class="{{ 'caught' if p.caught else 'missed' }}"><td>{{ p.bug }}</td><td>{{ p.component }}</td>
<td>{{ p.pitfall }}</td><td>{{ "caught" if p.caught else "NOT caught" }}</td><td>{{ p.diff_component }}</td></tr>
{% endfor %}</table>{% else %}<p>The planted-bug self-test did not run in this session.</p>{% endif %}

<h2>Versions</h2>
<table>{% for k, v in r.versions.items() %}<tr><th>{{ k }}</th><td>{{ v }}</td></tr>{% endfor %}</table>
</body></html>
"""

_ENV = Environment(autoescape=True)
_ENV.filters["css"] = lambda status: str(status).replace("/", "-").replace(" ", "-")


def render(results: dict[str, Any]) -> str:
    return _ENV.from_string(TEMPLATE).render(r=results, s=results["summary"])
