"""Strip run noise from executed notebooks before committing: per-cell execution metadata,
widget state and stderr streams (warnings, progress bars). Outputs that carry results stay.

    python dev/strip_notebooks.py notebooks/*.ipynb
"""

import json
import sys


def strip(path: str) -> None:
    with open(path) as f:
        nb = json.load(f)
    nb["metadata"].pop("widgets", None)
    for cell in nb["cells"]:
        cell.get("metadata", {}).pop("execution", None)
        if cell["cell_type"] == "code":
            cell["outputs"] = [o for o in cell["outputs"]
                               if not (o.get("output_type") == "stream" and o.get("name") == "stderr")]
    with open(path, "w") as f:
        json.dump(nb, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    for path in sys.argv[1:]:
        strip(path)
