"""The head: starts monitoring for a job, collects from every agent, stores series, computes findings."""
