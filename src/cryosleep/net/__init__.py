"""The job network: a private subnet per job, one address per node sandbox, linked by a bridge on a host and
by a VXLAN overlay across hosts (docs/network.md).

    plan      the address plan (pure): subnet, node addresses, bridge/VXLAN names, VNI, from the run id
    host      the host side (iproute2, nft): bridge and gateway, each sandbox's veth, the overlay, teardown
"""

from cryosleep.errors import NetError
from cryosleep.net.host import Host
from cryosleep.net.plan import IFNAME, JobNet, host_end_name, job_net, node_address

__all__ = ["IFNAME", "Host", "JobNet", "NetError", "host_end_name", "job_net", "node_address"]
