"""The table row of a run that lost a worker and restarted (bench/elastic.sh,
bench/launch.sh): the restart's fields from its metrics file, and the wall time per
step of the same run without a loss, plain and with the state kept.

    python3 bench/restart_row.py METRICS NAME STEPS T0 T1 T2 T3 [--shards]

--shards adds the shards the restart read from disk, after the step resumed from.
"""
import json
import sys

path, name = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3])
t = [float(x) for x in sys.argv[4:8]]
shards = "--shards" in sys.argv[8:]
plain, kept = 1e3 * (t[1] - t[0]) / steps, 1e3 * (t[3] - t[2]) / steps
for line in open(path):
    r = json.loads(line).get("restart")
    if r:
        print(f"| {name} | {r['workers_before']} -> {r['workers_after']} | "
              f"{r['lost_at_step']} | {r['resumed_from_step']} | "
              + (f"{r.get('shards_read', 0)} | " if shards else "") +
              f"{r['recovery_sec']:.3f} | {r['lost_sec']:.3f} | "
              f"{plain:.1f} | {kept:.1f} |")
