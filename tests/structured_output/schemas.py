"""Twenty varied JSON schemas, each bounded (string lengths, array sizes, number ranges) so
that a schema-valid document is short, with a prompt that asks the model for it."""

from __future__ import annotations

NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SHORT = {"type": "string", "maxLength": 12}

SCHEMAS: list[tuple[str, dict]] = [
    ("a person with a name and an age",
     {"type": "object", "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
      "required": ["name", "age"]}),
    ("a book with title, author and optional year",
     {"type": "object", "properties": {"title": NAME, "author": NAME,
                                       "year": {"type": "integer", "minimum": 1450, "maximum": 2025}},
      "required": ["title", "author"]}),
    ("a traffic light state",
     {"type": "object", "properties": {"color": {"enum": ["red", "yellow", "green"]}}, "required": ["color"]}),
    ("a list of one to three city names",
     {"type": "object", "properties": {"cities": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
      "required": ["cities"]}),
    ("a point with x and y coordinates between -10 and 10",
     {"type": "object", "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                                       "y": {"type": "integer", "minimum": -10, "maximum": 10}},
      "required": ["x", "y"]}),
    ("a user with a nested address",
     {"type": "object", "properties": {
         "user": {"type": "object", "properties": {
             "name": NAME,
             "address": {"type": "object", "properties": {"city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                         "required": ["city", "zip"]}},
                  "required": ["name", "address"]}},
      "required": ["user"]}),
    ("a temperature reading",
     {"type": "object", "properties": {"celsius": {"type": "number", "minimum": -50, "maximum": 60},
                                       "unit": {"const": "C"}},
      "required": ["celsius", "unit"]}),
    ("a yes or no answer",
     {"type": "object", "properties": {"answer": {"type": "boolean"}}, "required": ["answer"]}),
    ("an id that is either a number or a short code",
     {"type": "object", "properties": {"id": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 9999},
                                                        {"type": "string", "minLength": 2, "maxLength": 6}]}},
      "required": ["id"]}),
    ("a shopping list of two to four items with quantities",
     {"type": "object", "properties": {"items": {"type": "array", "minItems": 2, "maxItems": 4, "items": {
         "type": "object", "properties": {"item": SHORT, "qty": {"type": "integer", "minimum": 1, "maximum": 20}},
         "required": ["item", "qty"]}}},
      "required": ["items"]}),
    ("three scores between 0 and 100",
     {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 100}, "minItems": 3, "maxItems": 3}),
    ("a product with a price and optional tags",
     {"type": "object", "properties": {"product": NAME, "price": {"type": "number", "minimum": 0, "maximum": 1000},
                                       "tags": {"type": "array", "items": SHORT, "maxItems": 3}},
      "required": ["product", "price"]}),
    ("a weekday",
     {"type": "string", "enum": ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]}),
    ("a pet that is either a dog or a cat",
     {"anyOf": [
         {"type": "object", "properties": {"kind": {"const": "dog"}, "barks": {"type": "boolean"}}, "required": ["kind", "barks"]},
         {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["kind", "lives"]}]}),
    ("a matrix of 2 rows of 2 small integers",
     {"type": "object", "properties": {"matrix": {"type": "array", "minItems": 2, "maxItems": 2, "items": {
         "type": "array", "minItems": 2, "maxItems": 2, "items": {"type": "integer", "minimum": 0, "maximum": 9}}}},
      "required": ["matrix"]}),
    ("an event with a name, a priority and an optional note",
     {"type": "object", "properties": {"event": NAME, "priority": {"enum": ["low", "medium", "high", 1, 2, 3]},
                                       "note": {"type": ["string", "null"], "maxLength": 20}},
      "required": ["event", "priority"]}),
    ("a color as RGB values",
     {"type": "object", "properties": {c: {"type": "integer", "minimum": 0, "maximum": 255} for c in ("r", "g", "b")},
      "required": ["r", "g", "b"]}),
    ("a country with its capital and population in millions",
     {"type": "object", "properties": {"country": NAME, "capital": NAME,
                                       "population_millions": {"type": "number", "exclusiveMinimum": 0, "maximum": 2000}},
      "required": ["country", "capital", "population_millions"]}),
    ("a team with a leader and one to two members",
     {"type": "object", "properties": {"team": {"type": "object", "properties": {
         "leader": {"$ref": "#/$defs/member"},
         "members": {"type": "array", "items": {"$ref": "#/$defs/member"}, "minItems": 1, "maxItems": 2}},
         "required": ["leader", "members"]}},
      "required": ["team"],
      "$defs": {"member": {"type": "object", "properties": {"name": NAME, "role": {"enum": ["dev", "ops", "pm"]}},
                           "required": ["name", "role"]}}}),
    ("a settings object with a mode and optional limits",
     {"type": "object", "properties": {"mode": {"enum": ["fast", "safe"]}, "limits": {"type": "object", "properties": {
         "cpu": {"type": "integer", "minimum": 1, "maximum": 64}, "memory_gb": {"type": "number", "minimum": 0.5, "maximum": 512}}}},
      "required": ["mode"]}),
]
