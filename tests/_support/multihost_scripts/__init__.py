"""Scripts run on the simulated hosts of :mod:`tests._support.netns_hosts`."""
