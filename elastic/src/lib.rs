//! rekindle-elastic: rendezvous, membership and the agent (filled by the elastic work).
