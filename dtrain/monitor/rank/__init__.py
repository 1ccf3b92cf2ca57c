"""The rank-side client: what a training process calls to report its progress."""
