"""Running the processes: a private Redis server, the supervisor of `specpipe up`, and the
lab of network namespaces."""
