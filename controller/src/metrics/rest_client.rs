//! `rest_client_requests_total{code,method,host}`, as client-go counts its requests: a tower
//! layer on the kube client's HTTP stack. Every request the client sends passes through it
//! once (retries inside the stack included), and is counted when its answer's status line
//! arrives, or as `<error>` when none does.

use std::{
    sync::Arc,
    task::{Context, Poll},
};

use futures::{FutureExt, future::BoxFuture};
use http::{Request, Response};
use tower::{Layer, Service};

use super::Metrics;

/// Counts the requests of a client talking to `host` (`host:port`, as client-go labels it).
#[derive(Clone)]
pub struct RequestsLayer {
    metrics: Arc<Metrics>,
    host: Arc<str>,
}

impl RequestsLayer {
    /// A layer recording into `metrics`; `cluster_url` is the client's server.
    pub fn new(metrics: Arc<Metrics>, cluster_url: &http::Uri) -> Self {
        let host = cluster_url
            .authority()
            .map(|a| match a.port() {
                Some(_) => a.to_string(),
                None => {
                    let port = if cluster_url.scheme_str() == Some("http") {
                        80
                    } else {
                        443
                    };
                    format!("{}:{port}", a.host())
                }
            })
            .unwrap_or_default();
        Self {
            metrics,
            host: host.into(),
        }
    }
}

impl<S> Layer<S> for RequestsLayer {
    type Service = Requests<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Requests {
            inner,
            layer: self.clone(),
        }
    }
}

/// The service of [`RequestsLayer`].
#[derive(Clone)]
pub struct Requests<S> {
    inner: S,
    layer: RequestsLayer,
}

impl<S, B, R> Service<Request<B>> for Requests<S>
where
    S: Service<Request<B>, Response = Response<R>>,
    S::Future: Send + 'static,
    S::Error: 'static,
    R: 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = BoxFuture<'static, Result<S::Response, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let method = req.method().as_str().to_owned();
        let layer = self.layer.clone();
        self.inner
            .call(req)
            .map(move |res| {
                let code = match &res {
                    Ok(r) => r.status().as_u16().to_string(),
                    Err(_) => "<error>".to_owned(),
                };
                layer.metrics.request(code, &method, &layer.host);
                res
            })
            .boxed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn each_answer_is_counted_by_code_method_and_host() {
        let metrics = Arc::new(Metrics::default());
        let layer = RequestsLayer::new(metrics.clone(), &"https://10.96.0.1".parse().unwrap());
        let mut svc = layer.layer(tower::service_fn(|req: Request<()>| async move {
            let status = if req.uri().path() == "/missing" {
                404
            } else {
                200
            };
            Ok::<_, std::convert::Infallible>(Response::builder().status(status).body(()).unwrap())
        }));
        for path in ["/api", "/api", "/missing"] {
            let req = Request::get(path).body(()).unwrap();
            svc.call(req).await.unwrap();
        }
        let text = metrics.render();
        assert!(
            text.contains(
                r#"rest_client_requests_total{code="200",method="GET",host="10.96.0.1:443"} 2"#
            ),
            "{text}"
        );
        assert!(
            text.contains(
                r#"rest_client_requests_total{code="404",method="GET",host="10.96.0.1:443"} 1"#
            ),
            "{text}"
        );
    }
}
