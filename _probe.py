import sys, json, os
sys.path.insert(0, os.getcwd())
import mgloop
from tests.workers.methods_between_workers import config_for
for v in sys.argv[1:]:
    r = mgloop.run(config_for(f"threshold:value={v}", "/tmp/thr_probe_"+v, 0, "cpu:4", nodes=2))
    s = json.load(open(f"/tmp/thr_probe_{v}/0/summary.json"))
    print(v, json.dumps(s["link_model"]["tiers"]["between"]), s["link_model"]["dense_gradient_bytes_per_step"])
