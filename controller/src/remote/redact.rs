//! Messages built from untrusted, secret-bearing input (bootstrap data, a kubeconfig from a
//! Secret) made safe to show in conditions and Events, which anyone who can read the object
//! sees. Parsers quote the value they choke on (`invalid type: string "…"`), and that value can
//! be a join token or a private key: quoted values and token-shaped words are replaced, control
//! characters become spaces, and the message is cut to [`MAX_MESSAGE_BYTES`].

/// The longest message this module returns, in bytes. Events' notes are limited to 1 KiB, and a
/// condition message longer than this is not read anyway.
pub const MAX_MESSAGE_BYTES: usize = 512;

/// What a replaced value is shown as.
pub const REDACTED: &str = "<redacted>";

/// `msg` with quoted values and token-shaped words replaced, on one line, at most
/// [`MAX_MESSAGE_BYTES`] long.
///
/// Double-quoted text is always a value (serde's `string "…"`, Rust's `{:?}`). Backticked text is
/// usually a key path (`write_files[2].encoding`) and is kept unless it holds a token-shaped word
/// or anything but key-path characters (serde's `unknown variant \`…\`` quotes values that way).
pub fn untrusted_message(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len().min(MAX_MESSAGE_BYTES));
    let mut rest = msg;
    while let Some(i) = rest.find(['"', '`']) {
        out.push_str(&mask_words(&rest[..i]));
        let quote = rest[i..].chars().next().expect("found");
        let after = &rest[i + 1..];
        let Some(end) = closing(after, quote) else {
            // An unterminated quote: everything after it is the value.
            out.push(quote);
            out.push_str(REDACTED);
            rest = "";
            break;
        };
        let inner = &after[..end];
        out.push(quote);
        if quote == '`' && is_key_path(inner) {
            out.push_str(inner);
        } else {
            out.push_str(REDACTED);
        }
        out.push(quote);
        rest = &after[end + 1..];
    }
    out.push_str(&mask_words(rest));
    let one_line: String = out
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect();
    cap(&one_line, MAX_MESSAGE_BYTES)
}

/// `msg` cut to at most `max` bytes on a character boundary, ending in `…` when cut.
pub fn cap(msg: &str, max: usize) -> String {
    if msg.len() <= max {
        return msg.to_owned();
    }
    let ellipsis = '…';
    let mut end = max.saturating_sub(ellipsis.len_utf8());
    while !msg.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{ellipsis}", &msg[..end])
}

/// Where the quote opened just before `s` closes (a backslash escapes a double quote).
fn closing(s: &str, quote: char) -> Option<usize> {
    let mut escaped = false;
    for (i, c) in s.char_indices() {
        match c {
            '\\' if quote == '"' && !escaped => escaped = true,
            c if c == quote && !escaped => return Some(i),
            _ => escaped = false,
        }
    }
    None
}

/// A key path as the bootstrap converter prints it: `runcmd`, `write_files[2].encoding`.
fn is_key_path(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 128
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-.[]/".contains(c))
        && !s
            .split(|c: char| !is_secret_char(c) || c == '.')
            .any(is_secret_shaped)
        && !has_bootstrap_token(s)
}

/// Replaces token-shaped words (see [`is_secret_shaped`]) and kubeadm bootstrap tokens.
fn mask_words(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if is_secret_shaped(word) || has_bootstrap_token(word) {
            out.push_str(REDACTED);
        } else {
            out.push_str(word);
        }
        word.clear();
    };
    for c in s.chars() {
        if is_secret_char(c) {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// Characters of base64, hex and kubeadm tokens (`abcdef.0123456789abcdef`).
fn is_secret_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || "+/=_-.".contains(c)
}

/// A run of 20 or more base64/hex characters that mixes letters and digits: a key, a
/// certificate, a hash or a password-like string. Words of prose and key paths have no digits
/// or are shorter.
fn is_secret_shaped(word: &str) -> bool {
    let core = word.trim_matches(|c| c == '.' || c == '-');
    core.len() >= 20
        && core.chars().any(|c| c.is_ascii_digit())
        && core.chars().any(|c| c.is_ascii_alphabetic())
}

/// A kubeadm bootstrap token, `[a-z0-9]{6}.[a-z0-9]{16}`, anywhere in `s`.
fn has_bootstrap_token(s: &str) -> bool {
    let b = s.as_bytes();
    let tok = |c: u8| c.is_ascii_lowercase() || c.is_ascii_digit();
    // Every start `i` with `i + 23 <= len`.
    (0..b.len().saturating_sub(22)).any(|i| {
        b[i..i + 6].iter().all(|&c| tok(c))
            && b[i + 6] == b'.'
            && b[i + 7..i + 23].iter().all(|&c| tok(c))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const TOKEN: &str = "abcdef.0123456789abcdef";

    #[test]
    fn quoted_values_and_tokens_are_replaced_and_key_paths_kept() {
        let msg = format!(
            "cloud-config is not valid: runcmd: invalid type: string \"kubeadm join --token {TOKEN}\", expected a sequence at line 2 column 9"
        );
        let shown = untrusted_message(&msg);
        assert!(!shown.contains(TOKEN), "{shown}");
        assert!(!shown.contains("kubeadm join"), "{shown}");
        assert!(shown.contains("line 2 column 9"), "{shown}");

        let shown = untrusted_message("unsupported key `write_files[2].encodingx`: not supported");
        assert!(shown.contains("`write_files[2].encodingx`"), "{shown}");

        let shown = untrusted_message(&format!("unknown variant `{TOKEN}`, expected `b64`"));
        assert!(!shown.contains(TOKEN), "{shown}");
        assert!(shown.contains("`b64`"), "{shown}");

        let shown = untrusted_message(&format!(
            "bare {TOKEN} and a key c2VjcmV0LWtleS1tYXRlcmlhbC0xMjM0NQ=="
        ));
        assert!(!shown.contains(TOKEN), "{shown}");
        assert!(!shown.contains("c2VjcmV0"), "{shown}");
        assert!(shown.starts_with("bare "), "{shown}");

        let shown = untrusted_message("unterminated \"secret value");
        assert!(!shown.contains("secret value"), "{shown}");
    }

    #[test]
    fn a_long_message_is_cut_on_a_character_boundary() {
        let shown = untrusted_message(&"é".repeat(2000));
        assert!(shown.len() <= MAX_MESSAGE_BYTES, "{}", shown.len());
        assert!(shown.ends_with('…'));
        assert_eq!(untrusted_message("line one\nline two"), "line one line two");
    }
}
