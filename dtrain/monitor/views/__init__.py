"""What people read: `dtrain top`, the dashboard, the post-job report."""
