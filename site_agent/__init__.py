"""The hospital-side process: configuration, policy, durable privacy ledger, task handlers, dial-out client."""
