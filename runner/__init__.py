"""The per-member runner: started by the agent in its own session, it outlives the agent."""
