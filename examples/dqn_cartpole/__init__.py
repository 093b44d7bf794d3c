"""DQN on CartPole-v1 through a replay server: actors, a learner and the server in one demo.

``python -m examples.dqn_cartpole`` (or ``make demo``); see README.md beside this file.
"""
