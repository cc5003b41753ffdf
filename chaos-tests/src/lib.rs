//! rekindle-chaos-tests: fault-injection scenarios over real processes.
