"""OpenAI's Responses API (/v1/responses): request models and their translation into the shared
conversation, the wire (a whole response or its typed events), the routes over the one
generation path, and the stored responses that GET, DELETE and previous_response_id read (in
this process, and encrypted in Redis for the other replicas)."""
