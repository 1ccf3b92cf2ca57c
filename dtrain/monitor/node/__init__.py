"""The node agent: samples its node, keeps its ranks' metrics, serves both."""
