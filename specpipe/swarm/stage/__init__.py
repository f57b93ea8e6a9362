"""The parts a stage worker (`specpipe.swarm.stage.worker.StageWorker`) is built of, one job
each: admitting what its stream holds (`admission`), gathering rounds into batches
(`batching`), the forward (`forward`), where its output goes (`onward`), the tail's samplers
(`samplers`), sending (`sending`), the heartbeat (`heartbeat`), the sessions' activity and the
KV budget (`activity`, `budget`), its keys (`keys`) and its counters (`counters`)."""
