"""The hospital-side process.

Configuration, policy, the durable privacy ledger, task handlers and the dial-out client.
"""
