"""`dtrain dashboard`: a small HTTP server (stdlib) + one static page charting with plotly.js."""
