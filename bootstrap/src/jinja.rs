//! The cloud-init Jinja placeholders CABPK emits, substituted with the machine's own values.
//!
//! cloud-init renders the whole user data with Jinja when its first line is `## template: jinja`.
//! CABPK only uses the instance-data variables for the node name and instance id, so only those
//! are substituted; any other expression is an error rather than text left for a guest that has
//! no cloud-init to render it.

use crate::error::ConvertError;

/// The header line that switches cloud-init to Jinja rendering.
pub const JINJA_HEADER: &str = "## template: jinja";

/// Placeholders for the machine's hostname.
const HOSTNAME_VARS: &[&str] = &[
    "ds.meta_data.hostname",
    "ds.meta_data.local_hostname",
    "v1.local_hostname",
    "v1.hostname",
    "local_hostname",
];

/// Placeholders for the machine's instance id.
const INSTANCE_ID_VARS: &[&str] = &[
    "ds.meta_data.instance_id",
    "ds.meta_data.instance-id",
    "v1.instance_id",
    "instance_id",
];

/// Human list of the supported placeholders, for the error message.
pub const SUPPORTED: &str = "ds.meta_data.hostname, ds.meta_data.local_hostname, \
    v1.local_hostname, v1.hostname, local_hostname, ds.meta_data.instance_id, \
    v1.instance_id, instance_id";

/// Replaces every `{{ var }}` placeholder in `text`. `{%` statements, `{#` comments and unknown
/// variables are errors naming the expression and its line.
pub fn render(text: &str, hostname: &str, instance_id: &str) -> Result<String, ConvertError> {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut line = 1;
    while let Some(start) = find_open(rest) {
        let (before, tail) = rest.split_at(start);
        out.push_str(before);
        line += before.matches('\n').count();
        let kind = &tail[..2];
        let close = if kind == "{{" {
            "}}"
        } else if kind == "{%" {
            "%}"
        } else {
            "#}"
        };
        let Some(end) = tail[2..].find(close) else {
            return Err(unsupported(tail.lines().next().unwrap_or(tail), line));
        };
        let expression = &tail[..end + 4];
        if kind != "{{" {
            return Err(unsupported(expression, line));
        }
        let var = tail[2..end + 2].trim();
        let value = if HOSTNAME_VARS.contains(&var) {
            hostname
        } else if INSTANCE_ID_VARS.contains(&var) {
            instance_id
        } else {
            return Err(unsupported(expression, line));
        };
        out.push_str(value);
        line += expression.matches('\n').count();
        rest = &tail[end + 4..];
    }
    out.push_str(rest);
    Ok(out)
}

fn find_open(s: &str) -> Option<usize> {
    ["{{", "{%", "{#"].iter().filter_map(|o| s.find(o)).min()
}

fn unsupported(expression: &str, line: usize) -> ConvertError {
    ConvertError::UnsupportedTemplate {
        expression: expression.to_owned(),
        line,
        supported: SUPPORTED,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn substitutes_every_spelling() {
        let text = "a: {{ ds.meta_data.hostname }}\nb: {{v1.local_hostname}}\nc: {{ ds.meta_data.local_hostname }}\nd: {{ v1.instance_id }}\n";
        assert_eq!(
            render(text, "node-1", "i-42").unwrap(),
            "a: node-1\nb: node-1\nc: node-1\nd: i-42\n"
        );
    }

    #[test]
    fn unknown_variable_names_expression_and_line() {
        let err = render("x\ny: {{ ds.meta_data.region }}\n", "h", "i").unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "unsupported Jinja expression `{{{{ ds.meta_data.region }}}}` on line 2; only the \
                 hostname and instance-id placeholders ({SUPPORTED}) are substituted"
            )
        );
    }

    #[test]
    fn statements_and_unclosed_expressions_are_errors() {
        let err = render("{% if true %}x{% endif %}", "h", "i").unwrap_err();
        assert!(
            err.to_string().contains("`{% if true %}` on line 1"),
            "{err}"
        );
        let err = render("a\nb {{ v1.hostname\n", "h", "i").unwrap_err();
        assert!(
            err.to_string().contains("`{{ v1.hostname` on line 2"),
            "{err}"
        );
    }
}
