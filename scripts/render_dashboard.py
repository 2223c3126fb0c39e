#!/usr/bin/env python3
"""Renders the panels of deploy/grafana/rtflow.json to a PNG from a live Prometheus.

Grafana is not needed: each panel's PromQL expressions run over the Prometheus
HTTP API (/api/v1/query_range), with `$query` as Grafana fills it for "All" and
`$__rate_interval` as four scrape intervals, and are drawn with matplotlib
(pip install matplotlib). README's screenshot (docs/dashboard.png) was made so:

    scripts/render_dashboard.py --prometheus http://127.0.0.1:9090 \\
        --minutes 10 --output docs/dashboard.png
"""

import argparse
import datetime
import json
import math
import pathlib
import urllib.parse
import urllib.request

import matplotlib

matplotlib.use("Agg")
import matplotlib.dates as mdates  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parent.parent


def query_range(prometheus, expr, start, end, step):
    params = urllib.parse.urlencode(
        {"query": expr, "start": start, "end": end, "step": step}
    )
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}") as answer:
        body = json.load(answer)
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(template, labels):
    text = template
    for name, value in labels.items():
        text = text.replace("{{" + name + "}}", value)
    return text


def panels(dashboard):
    """The dashboard's panels with queries, in reading order."""
    found = []
    for panel in dashboard["panels"]:
        found.extend(panel.get("panels", []))
        if panel.get("targets"):
            found.append(panel)
    return sorted(found, key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prometheus", default="http://127.0.0.1:9090")
    parser.add_argument("--dashboard", default=ROOT / "deploy/grafana/rtflow.json")
    parser.add_argument("--query", default=".+", help="a regex of query names")
    parser.add_argument("--minutes", type=float, default=15)
    parser.add_argument("--scrape-interval", type=float, default=15, help="seconds")
    parser.add_argument("--output", default=ROOT / "docs/dashboard.png")
    args = parser.parse_args()

    dashboard = json.loads(pathlib.Path(args.dashboard).read_text())
    end = datetime.datetime.now(datetime.timezone.utc).timestamp()
    start = end - args.minutes * 60
    step = max(args.scrape_interval, args.minutes * 60 / 300)
    rate_interval = f"{int(4 * args.scrape_interval)}s"

    shown = panels(dashboard)
    columns = 3
    rows = math.ceil(len(shown) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(6 * columns, 2.6 * rows))
    for axis, panel in zip(axes.flat, shown):
        unit = panel["fieldConfig"]["defaults"].get("unit", "")
        for target in panel["targets"]:
            expr = (
                target["expr"]
                .replace("$__rate_interval", rate_interval)
                .replace("$query", args.query)
            )
            for series in query_range(args.prometheus, expr, start, end, step):
                times = [
                    datetime.datetime.fromtimestamp(float(t)) for t, _ in series["values"]
                ]
                values = [float(v) for _, v in series["values"]]
                if unit == "dateTimeAsIso":
                    # Watermarks as seconds behind the latest one, readable on an axis.
                    values = [(v - values[-1]) / 1000 for v in values]
                axis.plot(
                    times,
                    values,
                    linewidth=1,
                    label=legend(target.get("legendFormat", ""), series["metric"]),
                )
        if unit == "dateTimeAsIso":
            unit = "s, relative to the latest"
        title = panel["title"] + (f" [{unit}]" if unit not in ("", "none") else "")
        axis.set_title(title, fontsize=9)
        axis.tick_params(labelsize=7)
        axis.xaxis.set_major_formatter(mdates.DateFormatter("%H:%M"))
        if 0 < len(axis.lines) <= 8:
            axis.legend(fontsize=6, loc="upper left")
    for axis in list(axes.flat)[len(shown):]:
        axis.set_visible(False)
    figure.suptitle(f"{dashboard['title']} — the last {args.minutes:g} minutes")
    figure.tight_layout(rect=(0, 0, 1, 0.98))
    figure.savefig(args.output, dpi=80)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
