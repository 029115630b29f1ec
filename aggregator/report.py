"""HTML reports: summary tables and plots embedded as PNG (one self-contained file)."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (backend must be chosen first)
import numpy as np  # noqa: E402

#: ``plt`` is re-exported so plotting modules get pyplot with the Agg backend already chosen.
__all__ = ["Report", "figure_to_data_uri", "plt"]


def figure_to_data_uri(fig: Any) -> str:
    """Render a matplotlib figure as an embeddable ``data:image/png`` URI."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


@dataclass
class Report:
    """An HTML page built from sections of tables, text and images."""

    title: str
    sections: list[str] = field(default_factory=list)

    def heading(self, text: str) -> None:
        """Add a section heading."""
        self.sections.append(f"<h2>{html.escape(text)}</h2>")

    def paragraph(self, text: str) -> None:
        """Add a paragraph (escaped)."""
        self.sections.append(f"<p>{html.escape(text)}</p>")

    def table(self, header: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        """Add a table."""
        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_fmt(c))}</td>" for c in r) + "</tr>"
                       for r in rows)
        self.sections.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")

    def key_values(self, items: Mapping[str, Any],
                   header: tuple[str, str] = ("item", "value")) -> None:
        """Add a two-column table with a real header row."""
        self.table(header, [(k, v) for k, v in items.items()])

    def image(self, data_uri: str, alt: str) -> None:
        """Add an embedded image."""
        self.sections.append(f'<img src="{data_uri}" alt="{html.escape(alt)}">')

    def preformatted(self, text: str) -> None:
        """Add a block of monospace text."""
        self.sections.append(f"<pre>{html.escape(text)}</pre>")

    def render(self) -> str:
        """Return the whole page as HTML."""
        css = ("body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;"
               "color:#222}table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid "
               "#ccc;padding:4px 8px;text-align:left}th{background:#f3f3f3}pre{background:"
               "#f7f7f7;padding:1em;overflow-x:auto}img{max-width:100%}")
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>"
                f"{html.escape(self.title)}</title><style>{css}</style></head><body>"
                f"<h1>{html.escape(self.title)}</h1>{''.join(self.sections)}</body></html>")


def _fmt(value: Any) -> str:
    if isinstance(value, float | np.floating):
        return f"{value:.6g}"
    return str(value)
