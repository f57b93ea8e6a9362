"""The parts a stage worker (`specpipe.swarm.stage.worker.StageWorker`) is built of, one job
each: admitting what its stream holds (`admission`), gathering rounds into batches
(`batching`), the forward (`forward`), where its output goes (`onward`), the tail's samplers
(`samplers`), sending (`sending`, and `delayed_link` for a simulated slow link), the heartbeat
(`heartbeat`), the sessions' activity and the KV budget (`activity`, `budget`), its keys
(`keys`) and its counters (`counters`)."""
