"""Per run of the flow arm: the learned view's prediction accuracy (report.json) beside the share of the
flood's middle in which every replica had a prefill to do (busy.py), to show the two go together.

    python regimes.py OUT/RUN [OUT/RUN ...]
"""

import json
import subprocess
import sys
from pathlib import Path

BUSY = Path(__file__).parent.parent / "tenant-headroom" / "busy.py"

for run in sys.argv[1:]:
    arm = json.loads(Path(run, "report.json").read_text())["arms"]["prefix-pick-flow"]
    out = subprocess.run([sys.executable, str(BUSY), run, "prefix-pick-flow", "45", "95"],
                         capture_output=True, text=True, check=True).stdout.splitlines()[-1]
    print(f"{run}: accuracy {arm['prediction']['accuracy']:.3f}, busy {out.split('mean ')[1].split(';')[0]}, "
          f"served {arm['throughput_rps']:.2f} req/s over the run")
