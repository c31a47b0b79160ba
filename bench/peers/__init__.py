"""Other designs, served on the wire the load generator speaks, to compare the server against."""
