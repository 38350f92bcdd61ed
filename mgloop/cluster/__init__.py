"""Where a run executes: devices, worker processes, nodes, and the health of peers.

    devices.py      `--devices` parsed to a DeviceSet (towers, copy devices, towers per
                    device); logical CPU devices configured before TensorFlow starts
    options.py      the cluster part of the settings (`config.cluster`): where the towers are;
                    checks.py its check
    workers.py      the worker processes of a job (TF_CONFIG): Cluster, its rank and size
    worker_processes.py  the local worker processes of a job: started in their own process
                    groups, watched, signalled, named when one fails (imports no TensorFlow)
    launch_options.py  the launcher's own settings (`python -m mgloop.launch`): LaunchOptions,
                    its flags made from the fields; launch_checks.py its check
    elastic.py      `mgloop.launch --elastic`: a job restarted from a failure on the workers left
    node_layout.py  Nodes: which towers each node holds, its leader, device -> node
    peer_health.py  heartbeats between workers: a lost peer stops the job with one line
    nodes.py        the old name of node_layout.py, warning until mgloop 0.2
    netns.py        `mgloop.launch --netns`: each worker in a network namespace of its own on
                    a link shaped with tc tbf; the namespaces removed whatever ends the job

May import: mgloop's ground modules (errors, settings, phases) only. Everything else
imports this package, never the other way round.
"""
