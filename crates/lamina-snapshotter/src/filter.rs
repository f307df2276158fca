//! containerd's filter syntax, as `Walk` (the List RPC) receives it:
//! `fieldpath[op value][,fieldpath[op value]...]`, the selectors of one
//! filter joined by AND, several filters by OR. Operators `==`, `!=`, `~=`
//! (regular expression); a fieldpath alone tests presence. Field names and
//! values may be double-quoted (`labels."containerd.io/gc.root"==x`).

use regex_lite::Regex;

/// One parsed filter: all its selectors must match.
#[derive(Debug)]
pub struct Filter(Vec<Selector>);

#[derive(Debug)]
struct Selector {
    path: Vec<String>,
    op: Op,
}

#[derive(Debug)]
enum Op {
    Present,
    Equal(String),
    NotEqual(String),
    Matches(Regex),
}

/// What a filter asks of an object: the value at a field path, if present.
pub trait Fields {
    /// The value at `path`, `None` when absent.
    fn field(&self, path: &[String]) -> Option<String>;
}

/// Filters combined by OR; none at all matches everything.
pub fn matches_any(filters: &[Filter], obj: &impl Fields) -> bool {
    filters.is_empty() || filters.iter().any(|f| f.matches(obj))
}

impl Filter {
    /// Parses one filter string.
    pub fn parse(s: &str) -> Result<Filter, String> {
        let mut p = Parser { s, pos: 0 };
        let mut selectors = vec![p.selector()?];
        while p.eat(",") {
            selectors.push(p.selector()?);
        }
        p.skip_space();
        if p.pos != s.len() {
            return Err(format!("filter {s:?}: unexpected {:?}", &s[p.pos..]));
        }
        Ok(Filter(selectors))
    }

    /// True when every selector matches `obj`.
    pub fn matches(&self, obj: &impl Fields) -> bool {
        self.0.iter().all(|sel| {
            let value = obj.field(&sel.path);
            match &sel.op {
                Op::Present => value.is_some(),
                Op::Equal(v) => value.as_deref() == Some(v.as_str()),
                // As containerd: an absent field is "", which differs from
                // any non-empty value.
                Op::NotEqual(v) => value.unwrap_or_default() != *v,
                Op::Matches(re) => value.is_some_and(|x| re.is_match(&x)),
            }
        })
    }
}

struct Parser<'a> {
    s: &'a str,
    pos: usize,
}

impl Parser<'_> {
    fn rest(&self) -> &str {
        &self.s[self.pos..]
    }

    fn skip_space(&mut self) {
        let trimmed = self.rest().trim_start();
        self.pos = self.s.len() - trimmed.len();
    }

    fn eat(&mut self, token: &str) -> bool {
        self.skip_space();
        if self.rest().starts_with(token) {
            self.pos += token.len();
            true
        } else {
            false
        }
    }

    fn selector(&mut self) -> Result<Selector, String> {
        let mut path = vec![self.token(".,=!~")?];
        while self.eat(".") {
            path.push(self.token(".,=!~")?);
        }
        let op = if self.eat("==") {
            Op::Equal(self.token(",")?)
        } else if self.eat("!=") {
            Op::NotEqual(self.token(",")?)
        } else if self.eat("~=") {
            let re = self.token(",")?;
            Op::Matches(Regex::new(&re).map_err(|e| format!("filter {:?}: {e}", self.s))?)
        } else {
            Op::Present
        };
        Ok(Selector { path, op })
    }

    /// A quoted string, or the text up to one of `stops` (trimmed).
    fn token(&mut self, stops: &str) -> Result<String, String> {
        self.skip_space();
        if self.rest().starts_with('"') {
            return self.quoted();
        }
        let len = self
            .rest()
            .find(|c| stops.contains(c))
            .unwrap_or(self.rest().len());
        let token = self.rest()[..len].trim_end().to_string();
        self.pos += len;
        if token.is_empty() {
            return Err(format!(
                "filter {:?}: expected a field or value at byte {}",
                self.s, self.pos
            ));
        }
        Ok(token)
    }

    fn quoted(&mut self) -> Result<String, String> {
        let mut out = String::new();
        let mut chars = self.rest()[1..].char_indices();
        while let Some((i, c)) = chars.next() {
            match c {
                '"' => {
                    self.pos += i + 2;
                    return Ok(out);
                }
                '\\' => match chars.next() {
                    Some((_, 'n')) => out.push('\n'),
                    Some((_, 't')) => out.push('\t'),
                    Some((_, c)) => out.push(c),
                    None => break,
                },
                c => out.push(c),
            }
        }
        Err(format!("filter {:?}: unterminated quote", self.s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Obj(HashMap<&'static str, &'static str>);

    impl Fields for Obj {
        fn field(&self, path: &[String]) -> Option<String> {
            self.0.get(path.join(".").as_str()).map(|v| v.to_string())
        }
    }

    fn obj(pairs: &[(&'static str, &'static str)]) -> Obj {
        Obj(pairs.iter().copied().collect())
    }

    fn m(filter: &str, o: &Obj) -> bool {
        Filter::parse(filter).unwrap().matches(o)
    }

    #[test]
    fn selectors_and_operators() {
        let o = obj(&[
            ("name", "a-wl"),
            ("kind", "active"),
            ("labels.l", "2"),
            ("labels.containerd.io/gc.root", "x"),
        ]);
        assert!(m("name==a-wl", &o));
        assert!(!m("name==a", &o));
        assert!(m("name==a-wl,labels.l", &o));
        assert!(!m("name==a-wl,labels.missing", &o));
        assert!(m(r#"labels."containerd.io/gc.root"==x"#, &o));
        assert!(m(
            r#"kind==active, labels."containerd.io/gc.root" == "x""#,
            &o
        ));
        assert!(m(r#"parent!="""#, &obj(&[("parent", "p")])));
        assert!(!m(r#"parent!="""#, &o));
        assert!(m("name~=^a-", &o));
        assert!(!m("name~=^b", &o));
    }

    #[test]
    fn filters_are_ored() {
        let o = obj(&[("name", "p")]);
        let fs: Vec<Filter> = ["name==q", "name==p"]
            .iter()
            .map(|f| Filter::parse(f).unwrap())
            .collect();
        assert!(matches_any(&fs, &o));
        assert!(matches_any(&[], &o));
        assert!(!matches_any(&fs[..1], &o));
    }

    #[test]
    fn bad_filters_are_refused() {
        for bad in ["", "name==", r#"labels."open"#, "name==a,", "name~=("] {
            assert!(Filter::parse(bad).is_err(), "{bad:?} parsed");
        }
    }
}
