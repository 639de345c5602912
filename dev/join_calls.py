"""Join one device call's rows (CALL_CSV) to a file that keeps every call's rows (KEPT_CSV).

``python dev/join_calls.py CALL_CSV KEPT_CSV``. A row of the call replaces the kept row of the
same variant, batch and commit (the same call measured again, e.g. a stage re-run after a cut),
and leaves the other commits' rows alone: in ``long_context.csv`` each option is compared with
the q35lab row of its own call, and in ``packed_vs_padded.csv`` each variant's padded row with
its packed row of the same call, so every call's rows must stay.
"""

import sys
from pathlib import Path

import pandas as pd


def _keys(rows: pd.DataFrame) -> list[tuple]:
    batch = rows["batch"].fillna("") if "batch" in rows.columns else pd.Series("", index=rows.index)
    return list(zip(rows.variant, batch, rows.commit))


def join(call: pd.DataFrame, kept: pd.DataFrame) -> pd.DataFrame:
    """``kept`` without the rows ``call`` measures again (same variant, batch and commit), then ``call``."""
    again = set(_keys(call))
    kept = kept[[key not in again for key in _keys(kept)]]
    return pd.concat([kept, call], ignore_index=True)


if __name__ == "__main__":
    call_csv, kept_csv = map(Path, sys.argv[1:3])
    if call_csv.exists():
        kept = pd.read_csv(kept_csv) if kept_csv.exists() else pd.DataFrame(columns=["variant", "commit"])
        join(pd.read_csv(call_csv), kept).to_csv(kept_csv, index=False, float_format="%.5g")
