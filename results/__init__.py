"""Collecting runs, paired statistics, exports.

``stats`` turns the tidy runs table (one row per run) into seed-paired comparison rows;
``export`` renders and writes those rows. Both are pure functions of a pandas DataFrame.
"""

from reslab.results.export import EXPORT_FORMATS, PRINT_FORMATS, export_table, format_table
from reslab.results.stats import (
    COMPARE_COLUMNS,
    Comparison,
    benjamini_hochberg,
    compare,
    holm,
    paired_summary,
)

__all__ = [
    "COMPARE_COLUMNS",
    "EXPORT_FORMATS",
    "PRINT_FORMATS",
    "Comparison",
    "benjamini_hochberg",
    "compare",
    "export_table",
    "format_table",
    "holm",
    "paired_summary",
]
