//! openapi.yaml is the contract: the router serves exactly its operations,
//! and every response a test sees conforms to it.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, OnceLock};

use reqwest::{Method, StatusCode};
use serde_json::{Value, json};

use crate::helpers::{Reply, encode_id, spawn_app};

fn spec() -> &'static Value {
    static SPEC: OnceLock<Value> = OnceLock::new();
    SPEC.get_or_init(|| {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/openapi.yaml");
        let text = std::fs::read_to_string(path).expect("openapi.yaml is readable");
        serde_yaml::from_str(&text).expect("openapi.yaml is valid YAML")
    })
}

const METHODS: [&str; 5] = ["get", "put", "patch", "delete", "post"];

fn spec_operations() -> BTreeSet<(String, String)> {
    let paths = spec()["paths"].as_object().expect("paths");
    paths
        .iter()
        .flat_map(|(path, item)| {
            METHODS
                .iter()
                .filter(|m| item.get(**m).is_some())
                .map(move |m| (path.clone(), m.to_uppercase()))
        })
        .collect()
}

#[test]
fn router_and_openapi_have_the_same_operations() {
    let served: BTreeSet<(String, String)> = statehouse::http::operation_list()
        .into_iter()
        .map(|(path, method)| (path.to_owned(), method.as_str().to_owned()))
        .collect();
    let documented = spec_operations();
    let undocumented: Vec<_> = served.difference(&documented).collect();
    let unserved: Vec<_> = documented.difference(&served).collect();
    assert!(
        undocumented.is_empty(),
        "served but not in openapi.yaml: {undocumented:?}"
    );
    assert!(
        unserved.is_empty(),
        "in openapi.yaml but not served: {unserved:?}"
    );
}

#[test]
fn openapi_is_3_1_and_every_reference_resolves() {
    assert_eq!(spec()["openapi"], "3.1.0");
    let mut refs = Vec::new();
    collect_refs(spec(), &mut refs);
    assert!(!refs.is_empty());
    for reference in refs {
        assert!(resolve(&reference).is_some(), "dangling $ref {reference}");
    }
}

/// openapi.yaml's `maxLength` counts characters, the server UTF-8 bytes; the
/// schema's descriptions say so, and this pins the server's side. `€` is
/// three bytes.
#[tokio::test]
async fn length_limits_count_utf8_bytes() {
    let app = spawn_app().await;
    for (id, status) in [
        ("a".repeat(900), StatusCode::CREATED),
        ("€".repeat(300), StatusCode::CREATED),
        ("€".repeat(301), StatusCode::BAD_REQUEST),
    ] {
        let reply = app.put_state(&id, &json!({})).await;
        assert_eq!(reply.status, status, "{} bytes: {}", id.len(), reply.text);
        if status == StatusCode::BAD_REQUEST {
            assert_eq!(reply.problem_type(), "invalid-state-id");
        }
    }
    for (id, owner, status) in [
        (
            "owner-256",
            format!("{}a", "€".repeat(85)),
            StatusCode::CREATED,
        ),
        ("owner-258", "€".repeat(86), StatusCode::BAD_REQUEST),
    ] {
        let reply = app.acquire(id, &json!({"owner": owner})).await;
        assert_eq!(
            reply.status,
            status,
            "{} bytes: {}",
            owner.len(),
            reply.text
        );
    }
    for (pattern, status) in [
        (format!("{}a", "€".repeat(1365)), StatusCode::OK),
        ("€".repeat(1366), StatusCode::BAD_REQUEST),
    ] {
        let reply = app
            .get(&format!("/v1/states?pattern={}", encode_id(&pattern)))
            .await;
        assert_eq!(
            reply.status,
            status,
            "{} bytes: {}",
            pattern.len(),
            reply.text
        );
    }
}

fn collect_refs(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(map) => {
            if let Some(Value::String(r)) = map.get("$ref") {
                out.push(r.clone());
            }
            map.values().for_each(|v| collect_refs(v, out));
        }
        Value::Array(items) => items.iter().for_each(|v| collect_refs(v, out)),
        _ => {}
    }
}

fn resolve(reference: &str) -> Option<&'static Value> {
    spec().pointer(reference.strip_prefix('#')?)
}

fn deref(value: &'static Value) -> &'static Value {
    match value.get("$ref").and_then(Value::as_str) {
        Some(r) => deref(resolve(r).unwrap_or_else(|| panic!("dangling $ref {r}"))),
        None => value,
    }
}

/// The path template of openapi.yaml that a concrete (still percent-encoded) path falls under.
fn template_for(path: &str) -> Option<&'static str> {
    let segments: Vec<&str> = path.split('/').collect();
    spec()["paths"]
        .as_object()?
        .keys()
        .map(String::as_str)
        .find(|template| {
            let parts: Vec<&str> = template.split('/').collect();
            parts.len() == segments.len()
                && parts
                    .iter()
                    .zip(&segments)
                    .all(|(t, s)| (t.starts_with('{') && !s.is_empty()) || t == s)
        })
}

/// The validator of `schema`, compiled once per test process: compiling one
/// walks openapi.yaml's components, and was a fifth of the test binary's CPU
/// when it was done for every response. Each schema is a `'static` part of
/// the spec, so its address names it.
fn validator(schema: &'static Value, what: &str) -> Arc<jsonschema::Validator> {
    static VALIDATORS: OnceLock<Mutex<HashMap<usize, Arc<jsonschema::Validator>>>> =
        OnceLock::new();
    let validators = VALIDATORS.get_or_init(Mutex::default);
    let key = std::ptr::from_ref(schema) as usize;
    if let Some(validator) = validators.lock().unwrap().get(&key) {
        return Arc::clone(validator);
    }
    let root =
        json!({ "$ref": schema["$ref"].clone(), "components": spec()["components"].clone() });
    let root = if schema.get("$ref").is_some() {
        root
    } else {
        json!({ "allOf": [schema], "components": spec()["components"].clone() })
    };
    let compiled = Arc::new(
        jsonschema::draft202012::new(&root).unwrap_or_else(|e| panic!("schema for {what}: {e}")),
    );
    Arc::clone(validators.lock().unwrap().entry(key).or_insert(compiled))
}

fn validate(schema: &'static Value, instance: &Value, what: &str) {
    let errors: Vec<String> = validator(schema, what)
        .iter_errors(instance)
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors.is_empty(),
        "{what} does not conform to openapi.yaml: {errors:?}\nbody: {instance}"
    );
}

fn problem_schema() -> &'static Value {
    static PROBLEM: OnceLock<Value> = OnceLock::new();
    PROBLEM.get_or_init(|| json!({ "$ref": "#/components/schemas/Problem" }))
}

/// Panics unless `reply` is a response openapi.yaml documents for this request.
pub fn assert_conforms(method: &Method, path_and_query: &str, reply: &Reply) {
    let path = path_and_query.split('?').next().unwrap_or_default();
    let what = format!("{method} {path} -> {}", reply.status);
    let body = || {
        serde_json::from_str::<Value>(&reply.text)
            .unwrap_or_else(|e| panic!("{what}: body is not JSON ({e}): {}", reply.text))
    };
    let operation =
        template_for(path).and_then(|t| spec()["paths"][t].get(method.as_str().to_lowercase()));
    let Some(operation) = operation else {
        // Not an operation of the API: the only right answers are 404/405/400 problems.
        assert!(
            [400, 404, 405].contains(&reply.status.as_u16()),
            "{what}: undocumented request answered with a non-error"
        );
        validate(problem_schema(), &body(), &what);
        return;
    };
    let response = operation["responses"]
        .get(reply.status.as_str())
        .map(deref)
        .unwrap_or_else(|| panic!("{what}: status not documented in openapi.yaml"));
    let Some(content) = response.get("content").and_then(Value::as_object) else {
        assert!(
            reply.text.is_empty(),
            "{what}: documented without a body, got {}",
            reply.text
        );
        return;
    };
    let content_type = reply
        .header("content-type")
        .unwrap_or_else(|| panic!("{what}: no content-type"));
    let media = content
        .iter()
        .find(|(name, _)| content_type.starts_with(name.as_str()))
        .unwrap_or_else(|| panic!("{what}: content-type {content_type} not documented"));
    if media.0.contains("json") {
        validate(&media.1["schema"], &body(), &what);
    }
}
