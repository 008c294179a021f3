"""Collecting runs, paired statistics, power, exports.

``comparison`` is the one declared-comparison type (the study spec builds it); ``stats`` turns
the tidy runs table (one row per run) into seed-paired comparison rows; ``power`` says what a
comparison can show before anything runs; ``export`` renders and writes the rows. All are pure
functions of plain records or a pandas DataFrame.
"""

from reslab.results.comparison import Comparison
from reslab.results.export import EXPORT_FORMATS, PRINT_FORMATS, export_table, format_table
from reslab.results.stats import (
    COMPARE_COLUMNS,
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
