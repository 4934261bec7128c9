"""prefixgate nodes as Dynamo workers, for the tests: the cluster of loadtest.dynamo_cluster
(two nodes as separate processes, each its own pool, one thread), with the openai SDK against
Dynamo's own frontend, and the prompts the routing tests replay."""

from __future__ import annotations

import openai

from loadtest.dynamo_cluster import Cluster as NodesCluster
from loadtest.dynamo_cluster import computed


class Cluster(NodesCluster):
    def frontend(self, mode: str) -> openai.OpenAI:
        """An openai client of Dynamo's own frontend (`--router-mode mode`)."""
        return openai.OpenAI(base_url=self.frontend_url(mode) + "/v1", api_key="unused",
                             max_retries=0)


def system_prompt(topic: str, rules: int = 30) -> str:
    """About 19 tokens a rule (570 for the default 30)."""
    rules = " ".join(f"Rule {i}: answer questions about {topic} with care number {i}."
                     for i in range(rules))
    return f"You are an assistant for {topic}. {rules}"


def ask(client: openai.OpenAI, model: str, system: str, question: str = "Hello?"):
    return client.chat.completions.create(
        model=model, max_tokens=1, temperature=0,
        messages=[{"role": "system", "content": system}, {"role": "user", "content": question}])


def replay(cluster: Cluster, client: openai.OpenAI, model: str, topics: list[str],
           rules: int = 30) -> tuple[list[float], list[float], int]:
    """Every prompt (a system prompt of `rules` rules), then every prompt again: the prompt
    tokens each node computed in each round, and the second round's prompt tokens."""
    rounds, prompt_tokens = [], 0
    for _ in range(2):
        before = [computed(n) for n in cluster.nodes]
        prompt_tokens = sum(ask(client, model, system_prompt(t, rules)).usage.prompt_tokens
                            for t in topics)
        rounds.append([computed(n) - b for n, b in zip(cluster.nodes, before, strict=True)])
    return rounds[0], rounds[1], prompt_tokens
